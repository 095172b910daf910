"""The remote adapters' disk cache (appliance/lora/sources/cache.py): atomic landing, one download
for concurrent asks, least-recently-used eviction past the size bound."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from appliance.lora.sources.cache import DiskCache


def writer(size: int, delay_s: float = 0.0):
    def download(tmp: Path) -> None:
        time.sleep(delay_s)
        (tmp / "adapter_model.safetensors").write_bytes(b"x" * size)
    return download


def test_hit_after_download(tmp_path: Path) -> None:
    c = DiskCache(tmp_path, 10_000)
    d, fresh = c.get("s3://b/a", "etag:1", writer(100))
    assert fresh and (d / "adapter_model.safetensors").stat().st_size == 100
    d2, fresh2 = c.get("s3://b/a", "etag:1", writer(100))
    assert d2 == d and not fresh2 and c.downloads == 1
    d3, fresh3 = c.get("s3://b/a", "etag:2", writer(100))  # a new revision is a new entry
    assert fresh3 and d3 != d


def test_failed_download_leaves_nothing(tmp_path: Path) -> None:
    c = DiskCache(tmp_path, 10_000)

    def half_then_fail(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text("{}")
        raise OSError("connection reset")

    with pytest.raises(OSError):
        c.get("s3://b/a", "etag:1", half_then_fail)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".locks")] == []
    assert not c.entry_dir("s3://b/a", "etag:1").exists()


def test_concurrent_asks_share_one_download(tmp_path: Path) -> None:
    c = DiskCache(tmp_path, 10_000)
    out: list[Path] = []
    threads = [threading.Thread(target=lambda: out.append(c.get("s3://b/a", "etag:1", writer(10, 0.2))[0]))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.downloads == 1 and len(set(out)) == 1 and len(out) == 8


def test_two_instances_share_one_download(tmp_path: Path) -> None:
    """The lock is a file lock: a second cache object on the same dir (another process) waits too."""
    a, b = DiskCache(tmp_path, 10_000), DiskCache(tmp_path, 10_000)
    t = threading.Thread(target=lambda: a.get("s3://b/a", "etag:1", writer(10, 0.3)))
    t.start()
    time.sleep(0.05)
    _, fresh = b.get("s3://b/a", "etag:1", writer(10))
    t.join()
    assert not fresh and a.downloads + b.downloads == 1


def test_lru_eviction_past_the_bound(tmp_path: Path) -> None:
    c = DiskCache(tmp_path, 10_000)
    evicted: list[Path] = []
    c.on_evict = evicted.append
    da, _ = c.get("s3://b/a", "1", writer(100))
    size = c.entries()[0].size  # the weights and the entry's small .source.json
    c.max_bytes = 3 * size + 10  # room for three
    db, _ = c.get("s3://b/b", "1", writer(100))
    dc, _ = c.get("s3://b/c", "1", writer(100))
    os.utime(da, (1, 1)), os.utime(db, (2, 2)), os.utime(dc, (3, 3))
    assert c.lookup(da)  # a use: `a` is now the most recent, `b` the least
    dd, _ = c.get("s3://b/d", "1", writer(100))
    assert evicted == [db] and not db.exists() and all(p.exists() for p in (da, dc, dd))
    assert not c.lookup(db)
    assert sum(e.size for e in c.entries()) <= c.max_bytes


def test_entry_over_the_bound_is_kept_alone(tmp_path: Path) -> None:
    c = DiskCache(tmp_path, 150)
    da, _ = c.get("s3://b/a", "1", writer(100))
    db, _ = c.get("s3://b/b", "1", writer(140))
    assert not da.exists() and db.exists()
