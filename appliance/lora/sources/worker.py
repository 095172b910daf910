"""Remote fetches in worker processes (lora.fetch_in_subprocess): the store calls and the download of
an s3:// or hf:// adapter into the disk cache run in processes of their own, so boto3 and
huggingface_hub, pure Python for much of a download, never hold the server's GIL while the engine
thread steps (docs/performance.md, cold adapter loads).

The workers are started ('spawn': nothing of the server is inherited but its environment, where the
store credentials are) on the first fetch, at most `processes` of them, and killed by `close`. Each
runs the in-process path (AdapterSources.fetch: resolve, disk-cache flock, atomic rename, ETag or
revision check); the cache's file locks already serve several processes. A refusal comes back as the
same AdapterError class and message, nothing more (no remote traceback).
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Optional, Union

from appliance.lora.adapter_files import AdapterError
from appliance.lora.sources.uri import SourceError, SourceMissing

if TYPE_CHECKING:
    from appliance.config.schema import LoRAConfig
    from appliance.lora.sources.fetch import AdapterSources, Fetched

# The refusals a worker hands back, by name: the parent raises the same class.
_ERRORS: dict[str, type[AdapterError]] = {c.__name__: c for c in (AdapterError, SourceError, SourceMissing)}
_SOURCES: Optional["AdapterSources"] = None  # in a worker: its one AdapterSources (made by _start)


def _start(cfg: "LoRAConfig") -> None:
    """A worker's initializer: its fetchers (boto3, huggingface_hub) are made once, on first use."""
    from appliance.lora.sources.fetch import AdapterSources

    global _SOURCES
    _SOURCES = AdapterSources(cfg)


def _fetch(path: str) -> Union["Fetched", None, tuple[str, str]]:
    """In a worker: AdapterSources.fetch(path), or (error class name, message) for a refusal."""
    assert _SOURCES is not None
    try:
        return _SOURCES.fetch(path)
    except AdapterError as e:
        return (type(e).__name__ if type(e).__name__ in _ERRORS else "SourceError", str(e))


class FetchWorkers:
    def __init__(self, cfg: "LoRAConfig", processes: int, timeout_s: float) -> None:
        # timeout_s: the most one fetch may take here, worker start-up included (the worker bounds
        # the download itself by lora.fetch_timeout_s).
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.cfg = cfg
        self.processes = processes
        self.timeout_s = timeout_s
        self._pool: Optional[ProcessPoolExecutor] = None
        self._lock = threading.Lock()  # the pool is started once, by whichever thread fetches first

    def fetch(self, path: str) -> Optional["Fetched"]:
        """AdapterSources.fetch(path), run in a worker process (the calling thread waits, without the GIL)."""
        pool = self._started()
        try:
            out = pool.submit(_fetch, path).result(timeout=self.timeout_s)
        except BrokenProcessPool:
            self._reset(pool)
            raise SourceError(f"{path}: the fetch worker process exited; try again") from None
        except TimeoutError:
            raise SourceError(f"{path}: fetch took longer than {self.timeout_s:.0f} s") from None
        if isinstance(out, tuple):
            raise _ERRORS[out[0]](out[1])
        return out

    @property
    def started(self) -> int:
        """Worker processes alive now."""
        pool = self._pool
        return 0 if pool is None else sum(p.is_alive() for p in _processes(pool))

    def close(self) -> None:
        """Kill the workers (a download under way ends with them; its temp dir is left to the cache)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            self._kill(pool)

    def _started(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start, initargs=(self.cfg,))
            return self._pool

    def _reset(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        self._kill(pool)

    @staticmethod
    def _kill(pool: ProcessPoolExecutor) -> None:
        procs = _processes(pool)
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)


def _processes(pool: ProcessPoolExecutor) -> list[multiprocessing.process.BaseProcess]:
    # ProcessPoolExecutor kills no worker before Python 3.14 (kill_workers): its process table, read here.
    return list((pool._processes or {}).values())  # type: ignore[attr-defined]
