"""Background reads of cold adapters (lora.overlap_loading): disk -> host memory off the engine thread.

The manager hands `start` a closure that touches no engine state and collects outcomes with `poll` on
the engine thread, where all bookkeeping happens; the only shared state is this class's, behind its
lock. At most one read per key; a read whose key was dropped meanwhile runs on and is discarded.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar, Union

T = TypeVar("T")


@dataclass(frozen=True)
class ReadOutcome(Generic[T]):
    key: str
    result: Union[T, Exception]  # the weights, or what the read raised
    duration_s: float  # the read itself, queueing excluded

    @property
    def ok(self) -> bool:
        return not isinstance(self.result, Exception)


class BackgroundReader(Generic[T]):
    def __init__(self, threads: int, on_done: Optional[Callable[[], None]] = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lora-read")
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # started, outcome not yet polled
        self._done: list[ReadOutcome[T]] = []  # finished, not yet polled
        # Called on the reading thread after each read ends (the engine's doorbell: wakes the async loop).
        self._on_done = on_done

    def start(self, key: str, read: Callable[[], T]) -> bool:
        """Queue `read()` for `key` unless a read of it is already in flight. True when queued now."""
        with self._lock:
            if key in self._busy:
                return False
            self._busy.add(key)
        fut: Future = self._pool.submit(self._run, key, read)
        del fut  # outcomes come back through `poll`, never through the future
        return True

    def busy(self, key: str) -> bool:
        """A read of `key` is queued, running, or finished but not yet polled."""
        with self._lock:
            return key in self._busy

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._busy)

    def poll(self) -> list[ReadOutcome[T]]:
        """Outcomes of the reads finished since the last poll, in completion order."""
        with self._lock:
            out, self._done = self._done, []
            for o in out:
                self._busy.discard(o.key)
        return out

    def shutdown(self) -> None:
        """Stop taking reads; queued ones are cancelled, a running one ends on its own thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, key: str, read: Callable[[], T]) -> None:
        t0 = time.perf_counter()
        try:
            result: Union[T, Exception] = read()
        except Exception as e:  # noqa: BLE001 - handed to the engine thread, which fails the key's requests
            result = e
        outcome = ReadOutcome(key, result, time.perf_counter() - t0)
        with self._lock:
            self._done.append(outcome)
        if self._on_done is not None:
            self._on_done()
