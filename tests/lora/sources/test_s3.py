"""Remote adapters from S3 through AdapterSources (allowlist, S3 fetcher, disk cache) against moto's
real S3 API server: fetch and cache hits, ETag revisions, clean errors for what cannot be served,
one download for concurrent asks, eviction and re-fetch, credentials never echoed."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest

from appliance.config.schema import LoRAConfig
from appliance.lora.sources.fetch import AdapterSources
from appliance.lora.sources.uri import SourceError
from tests.lora.sources.conftest import ACCESS_KEY, BUCKET, SECRET_KEY, upload

CONFIG = b'{"peft_type": "LORA", "r": 4}'


def fake_adapter(dest: Path, weights: bytes = b"w" * 1000) -> Path:
    """Two files with the adapter names: the fetch layer moves bytes; the reader validates them later."""
    dest.mkdir(parents=True)
    (dest / "adapter_config.json").write_bytes(CONFIG)
    (dest / "adapter_model.safetensors").write_bytes(weights)
    return dest


def sources(s3_url: str, cache: Path, **kw) -> AdapterSources:
    cfg = LoRAConfig(allowed_sources=kw.pop("allowed", [f"s3://{BUCKET}/team"]), adapter_cache_dir=str(cache),
                     s3_endpoint_url=s3_url, s3_region="us-east-1", **kw)
    cfg.check()
    return AdapterSources(cfg)


def no_secret(text: str) -> None:
    assert SECRET_KEY not in text and ACCESS_KEY not in text


def test_fetch_then_hit_then_new_revision(s3, s3_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    uri = upload(s3, fake_adapter(tmp_path / "a"), "team/a")  # (the test's own client logs what it likes)
    caplog.set_level(logging.DEBUG)  # as server.log_level=debug does: botocore must still not log headers
    src = sources(s3_url, tmp_path / "cache")
    first = src.fetch(uri)
    assert first is not None and first.downloaded and first.source == uri
    assert (first.dir / "adapter_config.json").read_bytes() == CONFIG
    assert (first.dir / "adapter_model.safetensors").read_bytes() == b"w" * 1000
    assert first.revision.startswith("etag:") and first.dir.parent == tmp_path / "cache"
    again = src.fetch(uri + "/")  # the same adapter, normalised
    assert again is not None and not again.downloaded and again.dir == first.dir
    s3.put_object(Bucket=BUCKET, Key="team/a/adapter_model.safetensors", Body=b"v" * 1000)
    changed = src.fetch(uri)
    assert changed is not None and changed.downloaded and changed.revision != first.revision
    assert (changed.dir / "adapter_model.safetensors").read_bytes() == b"v" * 1000
    assert src.fetch(str(tmp_path / "local")) is None  # a local path is not the fetch layer's
    no_secret(caplog.text)


@pytest.mark.parametrize("what, uri, allowed, message", [
    ("outside the allowlist", "s3://adapters/other/a", None, "not under lora.allowed_sources"),
    ("a sibling prefix", "s3://adapters/team-evil/a", None, "not under lora.allowed_sources"),
    ("no allowlist", "s3://adapters/team/a", [], "empty: no remote source is allowed"),
    ("malformed", "s3://adapters/team/../other", None, "'..'"),
])
def test_refused_before_anything_is_fetched(s3, s3_url: str, tmp_path: Path, what: str, uri: str,
                                            allowed, message: str) -> None:
    upload(s3, fake_adapter(tmp_path / "a"), "other/a")
    kw = {} if allowed is None else {"allowed": allowed}
    src = sources(s3_url, tmp_path / "cache", **kw)
    with pytest.raises(SourceError, match=message):
        src.fetch(uri)
    assert not (tmp_path / "cache").exists()  # nothing fetched, not even the cache dir made


def test_missing_objects_and_size_bound(s3, s3_url: str, tmp_path: Path) -> None:
    src = sources(s3_url, tmp_path / "cache", max_adapter_bytes=5000, adapter_cache_bytes=10_000)
    with pytest.raises(SourceError, match=r"s3://adapters/team/nothing/adapter_config.json does not exist \(not a PEFT"):
        src.fetch("s3://adapters/team/nothing")
    only_weights = tmp_path / "w"
    fake_adapter(only_weights)
    (only_weights / "adapter_config.json").unlink()
    with pytest.raises(SourceError, match="adapter_config.json does not exist"):
        src.fetch(upload(s3, only_weights, "team/weights-only"))
    big = upload(s3, fake_adapter(tmp_path / "big", b"b" * 6000), "team/big")
    with pytest.raises(SourceError, match=r"more than lora.max_adapter_bytes \(5000\); refused unread"):
        src.fetch(big)
    gone = upload(s3, fake_adapter(tmp_path / "gone"), "team/gone")
    s3.delete_object(Bucket=BUCKET, Key="team/gone/adapter_model.safetensors")
    with pytest.raises(SourceError, match="adapter_model.safetensors does not exist"):
        src.fetch(gone)
    no_bucket = sources(s3_url, tmp_path / "cache", allowed=["s3://no-such-bucket"])
    with pytest.raises(SourceError, match="does not exist"):
        no_bucket.fetch("s3://no-such-bucket/a")
    assert src.cache.entries() == []


def test_concurrent_fetches_share_one_download(s3, s3_url: str, tmp_path: Path) -> None:
    uri = upload(s3, fake_adapter(tmp_path / "a", b"c" * 200_000), "team/concurrent")
    src = sources(s3_url, tmp_path / "cache")
    out = []
    threads = [threading.Thread(target=lambda: out.append(src.fetch(uri))) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 16 and len({f.dir for f in out}) == 1
    assert src.cache.downloads == 1 and sum(f.downloaded for f in out) == 1


def test_eviction_then_refetch(s3, s3_url: str, tmp_path: Path) -> None:
    uris = [upload(s3, fake_adapter(tmp_path / n, n.encode() * 1000), f"team/lru-{n}") for n in "abc"]
    src = sources(s3_url, tmp_path / "cache", max_adapter_bytes=1200, adapter_cache_bytes=2500)
    a, b = src.fetch(uris[0]), src.fetch(uris[1])
    assert src.refresh(uris[0], a.dir) == a.dir  # a use of `a`: `b` is now the least recently used
    c = src.fetch(uris[2])
    assert a.dir.exists() and not b.dir.exists() and c.dir.exists()
    assert src.refresh(uris[1], b.dir) == b.dir and b.dir.exists()  # gone from disk: fetched again
    assert src.cache.downloads == 4


def test_timeout_and_unreachable_are_clean_and_never_name_credentials(s3, s3_url: str, tmp_path: Path) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are accepted by the kernel and never answered
    try:
        src = sources(f"http://127.0.0.1:{silent.getsockname()[1]}", tmp_path / "cache", fetch_timeout_s=0.3)
        with pytest.raises(SourceError, match=r"S3 request failed \(ReadTimeoutError\)") as e:
            src.fetch("s3://adapters/team/a")
        no_secret(str(e.value))
    finally:
        silent.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(SourceError, match=r"S3 request failed \(EndpointConnectionError\)") as e:
        sources(f"http://127.0.0.1:{port}", tmp_path / "cache", fetch_timeout_s=1).fetch("s3://adapters/team/a")
    no_secret(str(e.value))


def test_bad_config_keys() -> None:
    from appliance.config.schema import ConfigError

    for kw, msg in [(dict(allowed_sources=["s3://okay", "gs://x"]), r"lora.allowed_sources\[1\]"),
                    (dict(s3_endpoint_url=f"http://{ACCESS_KEY}:{SECRET_KEY}@minio:9000"), "without user info"),
                    (dict(s3_endpoint_url="minio:9000"), "http:// or https://"),
                    (dict(max_adapter_bytes=10, adapter_cache_bytes=5), "adapter_cache_bytes: must be >="),
                    (dict(fetch_timeout_s=0), "fetch_timeout_s")]:
        with pytest.raises(ConfigError, match=msg) as e:
            LoRAConfig(**kw).check()
        no_secret(str(e.value))
