"""Host -> GPU slot copies on a side CUDA stream, enqueued by a copy thread (lora.overlap_loading on CUDA).

`copy` (engine thread) only marks where the compute stream is (an event: steps enqueued before it may
still read the slot's previous adapter) and queues the job. The copy thread, in queue order, packs the
pageable CPU-tier weights into a page-locked staging buffer (lora/staging.py), makes the side stream
wait for that mark, enqueues the slot's few large copies and an end event, and gives the buffer back
once that event completed. The first step using the slot waits on the end event on the device, never
on the host; the scheduler holds that slot's requests while `done` is false. Nothing is page-locked
after start-up. One thread keeps copies into one slot in order. CPU twin: LoRAManager._fill_slot.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from appliance.lora.staging import SlotImage, StagingPool, Weights

log = logging.getLogger(__name__)


class CudaOps:
    """The few stream and event calls the copier makes (a seam: tests drive the copier on CPU with a
    fake of this)."""

    def __init__(self, device: torch.device) -> None:
        # An index the copy thread can select (torch.cuda.set_device refuses a bare "cuda").
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())

    def stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def event(self, timing: bool = False) -> Any:
        # blocking: the copy thread sleeps in synchronize() instead of spinning a core
        return torch.cuda.Event(enable_timing=timing, blocking=True)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)


@dataclass
class _Copy:
    slot: int
    key: str
    weights: Optional[Weights]  # the pageable source, dropped once packed
    after: Any  # event on the compute stream at `copy`: the side stream starts after it
    start: Any
    end: Any
    enqueued: threading.Event = field(default_factory=threading.Event)  # set by the copy thread
    error: Optional[BaseException] = None  # packing or enqueueing failed: the slot holds no valid weights


class SlotCopier:
    def __init__(self, image: SlotImage, staging: StagingPool, ops: Any) -> None:
        # ops: CudaOps(device) (a fake in the tests)
        self.image = image
        self.staging = staging
        self.ops = ops
        self.stream = ops.stream()
        self._pending: dict[int, _Copy] = {}  # slot -> its latest copy, until a step waited on it or it completed
        self._timing: list[_Copy] = []  # every copy whose outcome (duration or failure) has not been read yet
        self._jobs: queue.SimpleQueue[Optional[_Copy]] = queue.SimpleQueue()
        self._busy: deque[tuple[_Copy, torch.Tensor]] = deque()  # copy thread only: buffers still being read
        self._thread = threading.Thread(target=self._run, name="lora-copy", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def copy(self, slot: int, key: str, weights: Weights) -> None:
        """Queue the copy of `weights` (checked to fit: layers.check_adapter_fits) into `slot`."""
        after = self.ops.event()
        after.record(self.ops.current())
        c = _Copy(slot, key, weights, after, self.ops.event(timing=True), self.ops.event(timing=True))
        self._pending[slot] = c  # a later copy into the same slot runs after this one (one thread, one stream)
        self._timing.append(c)
        self._jobs.put(c)

    def enqueued(self, slot: int) -> Optional[BaseException]:
        """Block until the latest copy into `slot` is on the side stream (packing, tens of ms for a
        large adapter); what failed it, if anything. For fills whose requests run in this very step."""
        c = self._pending.get(slot)
        if c is None:
            return None
        c.enqueued.wait()
        return c.error

    def done(self, slot: int) -> bool:
        """True when `slot` has no copy still queued or running (host-side query, no sync). A failed
        copy stays not done until `failures` reported it."""
        c = self._pending.get(slot)
        if c is None:
            return True
        if c.enqueued.is_set() and c.error is None and c.end.query():
            del self._pending[slot]
            return True
        return False

    def wait(self, slots: Iterable[int]) -> None:
        """Make the compute stream wait for the copies into `slots` (device-side; free once completed).
        A copy still being packed is waited for on the host first (its end event must exist)."""
        compute = self.ops.current()
        for s in set(slots):
            c = self._pending.pop(s, None)
            if c is None:
                continue
            c.enqueued.wait()
            if c.error is not None:
                raise RuntimeError(f"copying adapter {c.key!r} into slot {s} failed: {c.error}")
            compute.wait_event(c.end)

    @property
    def in_flight(self) -> int:
        """Copies queued, packing or enqueued and not yet completed."""
        return sum(not self._completed(c) for c in self._timing)

    def finished_durations(self) -> list[float]:
        """Device durations (seconds) of the copies completed since the last call (failures: `failures`)."""
        out, left = [], []
        for c in self._timing:
            if not self._completed(c):
                left.append(c)
            elif c.error is None:
                out.append(c.start.elapsed_time(c.end) / 1e3)
            else:
                left.append(c)  # until `failures` takes it
        self._timing = left
        return out

    def failures(self) -> list[tuple[int, str, str]]:
        """(slot, key, why) of the copies that failed since the last call; their slots are forgotten."""
        out, left = [], []
        for c in self._timing:
            if c.enqueued.is_set() and c.error is not None:
                out.append((c.slot, c.key, f"{type(c.error).__name__}: {c.error}"))
                if self._pending.get(c.slot) is c:
                    del self._pending[c.slot]
            else:
                left.append(c)
        self._timing = left
        return out

    def close(self) -> None:
        """Stop the copy thread after the copies already queued (not waited for: a daemon thread)."""
        self._jobs.put(None)

    @staticmethod
    def _completed(c: _Copy) -> bool:
        return c.enqueued.is_set() and (c.error is not None or c.end.query())

    # ------------------------------------------------------------------ copy thread
    def _run(self) -> None:
        try:
            self.ops.enter_thread()
            broken: Optional[BaseException] = None
        except Exception as e:  # noqa: BLE001 - every copy then fails with it (never hangs its requests)
            log.exception("the slot copy thread could not select its device")
            broken = e
        while True:
            c = self._jobs.get()
            if c is None:
                return
            if broken is not None:
                c.error, c.weights = broken, None
                c.enqueued.set()
                continue
            self._one(c)
            if self._jobs.empty():
                try:
                    self._reclaim(block=True)  # idle: every buffer back in the pool
                except Exception:  # noqa: BLE001 - the thread must go on (the next copy reports a broken device)
                    log.exception("waiting for slot copies failed")

    def _one(self, c: _Copy) -> None:
        buf: Optional[torch.Tensor] = None
        try:
            buf = self._buffer()
            self.image.pack(buf, c.weights)  # type: ignore[arg-type]
            with self.ops.use(self.stream):
                self.stream.wait_event(c.after)  # enqueued steps may still read this slot's old weights
                c.start.record(self.stream)
                self.image.unpack(c.slot, buf)
                c.end.record(self.stream)
        except Exception as e:  # noqa: BLE001 - reported to the engine thread (failures), which fails the key
            c.error = e
            log.error("adapter %r: slot copy failed: %s", c.key, e)
            if buf is not None:
                try:
                    c.end.record(self.stream)  # what was enqueued may still read `buf`
                except Exception:  # noqa: BLE001 - the device is broken: the buffer is never reused
                    buf = None
        finally:
            c.weights = None
            if buf is not None:
                self._busy.append((c, buf))
            c.enqueued.set()

    def _buffer(self) -> torch.Tensor:
        """A free staging buffer; waits (sleeping, on this thread) for the oldest copy when none is free."""
        self._reclaim(block=False)
        buf = self.staging.take()
        while buf is None:
            self._busy[0][0].end.synchronize()
            self._reclaim(block=False)
            buf = self.staging.take()
        return buf

    def _reclaim(self, block: bool) -> None:
        """Give back the buffers of completed copies (with `block`: wait for all of them)."""
        while self._busy:
            c, buf = self._busy[0]
            if block:
                c.end.synchronize()
            elif not c.end.query():
                return
            self._busy.popleft()
            self.staging.give(buf)
