"""The local disk tier of remote adapters: one directory per (source URI, revision) under
lora.adapter_cache_dir, bounded by lora.adapter_cache_bytes with least-recently-used eviction.

- A download lands in a temp dir beside the entries and is renamed into place once complete, so an
  entry that exists is whole; a failed download leaves nothing.
- Concurrent asks for one entry share one download: each entry has a lock file taken with flock, so
  threads and processes (the server, `appliance validate`) that want it wait for the first one's
  download and then find it in place.
- Last use is the entry directory's mtime (touched on every hit); eviction runs after each download,
  under a cache-wide lock, and skips entries whose lock another caller holds.
Pure Python (no torch): the fetchers write files, this only places, finds and removes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

META_FILE = ".source.json"  # what the entry holds: its URI and revision (never a credential)


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    size: int  # bytes of its files
    last_used: float  # the dir's mtime


class DiskCache:
    def __init__(self, root: Path, max_bytes: int, on_evict: Optional[Callable[[Path], None]] = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.downloads = 0  # downloads this instance ran (tests: one per entry under concurrency)

    def entry_dir(self, source: str, revision: str) -> Path:
        return self.root / hashlib.sha256(f"{source}\0{revision}".encode()).hexdigest()[:32]

    def lookup(self, path: Path) -> bool:
        """Whether `path` is a whole entry still on disk; touches it (a use) when it is."""
        with self._lock(path.name):
            if not path.is_dir():
                return False
            os.utime(path)
            return True

    def get(self, source: str, revision: str, download: Callable[[Path], None]) -> tuple[Path, bool]:
        """The entry dir of (source, revision), downloaded into it by `download(tmp_dir)` unless it is
        there already; and whether this call downloaded it. `download` raises to refuse: nothing stays."""
        final = self.entry_dir(source, revision)
        with self._lock(final.name):
            if final.is_dir():
                os.utime(final)
                return final, False
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
            try:
                self.downloads += 1
                download(tmp)
                (tmp / META_FILE).write_text(json.dumps({"source": source, "revision": revision}))
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        self.evict(keep=final)
        return final, True

    def entries(self) -> list[CacheEntry]:
        out = []
        for p in self.root.iterdir() if self.root.is_dir() else ():
            if p.name.startswith(".") or not p.is_dir():
                continue
            try:
                size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
                out.append(CacheEntry(p, size, p.stat().st_mtime))
            except FileNotFoundError:  # evicted meanwhile by another process
                continue
        return out

    def evict(self, keep: Optional[Path] = None) -> list[Path]:
        """Remove least recently used entries until the cache fits max_bytes; never `keep` (just
        fetched) nor an entry another caller is downloading or looking up."""
        removed: list[Path] = []
        with self._lock(".evict"):
            entries = sorted(self.entries(), key=lambda e: e.last_used)
            total = sum(e.size for e in entries)
            for e in entries:
                if total <= self.max_bytes:
                    break
                if e.path == keep:
                    continue
                with self._try_lock(e.path.name) as got:
                    if not got:
                        continue
                    gone = self.root / f".del-{e.path.name}-{os.getpid()}"
                    os.rename(e.path, gone)  # atomic: readers see the whole entry or none
                    shutil.rmtree(gone, ignore_errors=True)
                total -= e.size
                removed.append(e.path)
                if self.on_evict is not None:
                    self.on_evict(e.path)
        return removed

    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        fd = self._lock_fd(name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    @contextlib.contextmanager
    def _try_lock(self, name: str) -> Iterator[bool]:
        fd = self._lock_fd(name)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _lock_fd(self, name: str) -> int:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        return os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
