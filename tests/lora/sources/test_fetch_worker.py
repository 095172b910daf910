"""lora.fetch_in_subprocess (lora/sources/worker.py) against moto's real S3 API server: the fetch runs
in a spawned worker process and hands back the same cache entry, revision and download count as the
in-process path; refusals come back as the same AdapterError class and message, never naming a
credential; a worker that dies fails its fetch cleanly and the next fetch starts a fresh one; close
kills them. Then the whole cold-adapter bench with the fetch in workers."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from appliance.config.schema import LoRAConfig
from appliance.lora.sources.fetch import AdapterSources
from appliance.lora.sources.uri import SourceError, SourceMissing
from appliance.lora.sources.worker import FetchWorkers
from tests.lora.sources.conftest import BUCKET, upload
from tests.lora.sources.test_s3 import fake_adapter, no_secret


def pair(s3_url: str, cache: Path, processes: int = 2, timeout_s: float = 120.0,
         **kw) -> tuple[AdapterSources, AdapterSources]:
    """(in workers, in process) over one config."""
    cfg = LoRAConfig(allowed_sources=[f"s3://{BUCKET}/team"], adapter_cache_dir=str(cache), s3_endpoint_url=s3_url,
                     s3_region="us-east-1", fetch_in_subprocess=True, **kw)
    cfg.check()
    return AdapterSources(cfg, FetchWorkers(cfg, processes, timeout_s)), AdapterSources(cfg)


def test_fetch_in_a_worker_gives_the_in_process_result(s3, s3_url: str, tmp_path: Path) -> None:
    uri = upload(s3, fake_adapter(tmp_path / "a", b"x" * 300_000), "team/worker-a")
    src, local = pair(s3_url, tmp_path / "cache")
    try:
        first = src.fetch(uri)
        assert src.workers is not None and src.workers.started >= 1
        assert first is not None and first.downloaded and first.source == uri and first.revision.startswith("etag:")
        assert (first.dir / "adapter_model.safetensors").read_bytes() == b"x" * 300_000
        assert src.cache.downloads == 1  # counted here, though the worker downloaded
        hit = local.fetch(uri)  # the in-process path finds the worker's entry: same dir, no download
        assert hit is not None and not hit.downloaded and (hit.dir, hit.revision) == (first.dir, first.revision)
        out = []
        threads = [threading.Thread(target=lambda: out.append(src.fetch(uri + "/"))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(out) == 6 and {f.dir for f in out} == {first.dir} and not any(f.downloaded for f in out)
        s3.put_object(Bucket=BUCKET, Key="team/worker-a/adapter_model.safetensors", Body=b"y" * 1000)
        changed = src.fetch(uri)
        assert changed is not None and changed.downloaded and changed.revision != first.revision
        assert src.refresh(uri, changed.dir) == changed.dir and src.cache.downloads == 2
    finally:
        src.close()
    assert src.workers.started == 0


def test_refusals_come_back_as_the_same_errors(s3, s3_url: str, tmp_path: Path) -> None:
    src, local = pair(s3_url, tmp_path / "cache", processes=1, max_adapter_bytes=5000)
    big = upload(s3, fake_adapter(tmp_path / "big", b"b" * 6000), "team/worker-big")
    try:
        for uri, cls in (("s3://adapters/team/nothing", SourceMissing), (big, SourceError)):
            with pytest.raises(SourceError) as want:
                local.fetch(uri)
            with pytest.raises(SourceError) as got:
                src.fetch(uri)
            assert type(got.value) is type(want.value) is cls and str(got.value) == str(want.value)
            assert got.value.__cause__ is None  # no remote traceback attached
            no_secret(str(got.value))
        with pytest.raises(SourceError, match="not under lora.allowed_sources"):
            src.fetch("s3://adapters/other/a")  # refused here, before any store call
    finally:
        src.close()


def test_a_worker_that_dies_fails_its_fetch_and_the_next_starts_afresh(s3, s3_url: str, tmp_path: Path) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepted by the kernel, never answered: the worker's fetch hangs on it
    host, port = silent.getsockname()
    cfg = LoRAConfig(allowed_sources=[f"s3://{BUCKET}/team"], adapter_cache_dir=str(tmp_path / "cache"),
                     s3_endpoint_url=f"http://{host}:{port}", s3_region="us-east-1", fetch_timeout_s=30)
    workers = FetchWorkers(cfg, 1, timeout_s=120)
    src = AdapterSources(cfg, workers)
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            src.fetch(f"s3://{BUCKET}/team/a")
        except SourceError as e:
            errors.append(e)

    t = threading.Thread(target=fetch)
    t.start()
    deadline = time.monotonic() + 60
    while workers.started == 0:
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    time.sleep(0.5)
    for p in list(workers._pool._processes.values()):  # type: ignore[union-attr]
        os.kill(p.pid, signal.SIGKILL)
    t.join(60)
    silent.close()
    assert len(errors) == 1 and "fetch worker process exited" in str(errors[0])
    good, _ = pair(s3_url, tmp_path / "cache2", processes=1)
    uri = upload(s3, fake_adapter(tmp_path / "a"), "team/worker-after")
    try:
        f = good.fetch(uri)
        assert f is not None and f.downloaded
    finally:
        good.close()
        workers.close()


def test_cold_mix_with_fetches_in_workers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`appliance bench serve --cold-adapters` end to end with lora.fetch_in_subprocess=true: every cold
    adapter fetched (in a worker of the server) and read once, every request served."""
    import json

    from appliance.cli import main
    from tests.bench.test_bench_serve_cold import _bench, _check_cold_row

    rc = main(_bench(tmp_path, "lora.fetch_in_subprocess=true"))
    assert rc == 0, capsys.readouterr().out
    res = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert res["errors"] == {} and res["server"]["exit_status"] == 0
    assert "lora.fetch_in_subprocess=true" in res["server"]["overrides"]
    _check_cold_row(res)


def test_engine_fetches_in_workers_and_stops_them_on_close(s3, s3_url: str, tmp_path: Path,
                                                           tiny_model_dir: Path) -> None:
    """The wiring: lora.fetch_in_subprocess gives the manager fetch workers; a load from s3:// starts
    one and serves the adapter's tokens (equal to the in-process engine's); LLMEngine.close kills them."""
    from tests.lora.test_lora_engine import ADAPTERS, make_adapter, lora_engine, run_mixed

    d = make_adapter(tiny_model_dir, tmp_path / "qv4", seed=31, **ADAPTERS["qv4"])
    uri = upload(s3, d, "team/engine-qv4")
    common = (f"lora.allowed_sources=[s3://{BUCKET}/team]", f"lora.s3_endpoint_url={s3_url}",
              "lora.s3_region=us-east-1")
    engines = {flag: lora_engine(tiny_model_dir, tmp_path, *common, f"lora.adapter_cache_dir={tmp_path / flag}",
                                 f"lora.fetch_in_subprocess={flag}") for flag in ("true", "false")}
    tokens = {}
    for flag, engine in engines.items():
        assert (engine.lora.sources.workers is not None) == (flag == "true")  # type: ignore[union-attr]
        engine.lora.load("qv4", uri)  # type: ignore[union-attr]
        tokens[flag] = run_mixed(engine, [("qv4", 0)])
    workers = engines["true"].lora.sources.workers  # type: ignore[union-attr]
    assert workers is not None and workers.started >= 1 and tokens["true"] == tokens["false"]
    for engine in engines.values():
        engine.close()
    assert workers.started == 0
