"""Host -> GPU slot copies on a side CUDA stream (lora.overlap_loading on a CUDA device).

A copy is queued after the compute stream's pending work (a step still reading the slot's previous
adapter finishes first) and ends with an event; the first step using the slot waits on it on the
device, never on the host, and the scheduler holds that slot's requests while `done` is false.
Durations come from completed timing events, so metrics need no sync. CPU twin: LoRAManager._fill_slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch


@dataclass
class _Copy:
    slot: int
    start: torch.cuda.Event
    end: torch.cuda.Event
    keep: object  # the host tensors being copied: alive until the copy has completed


class SlotCopier:
    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"SlotCopier needs a CUDA device, got {device}")
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._pending: dict[int, _Copy] = {}  # slot -> its latest copy, until a step waited on it or it completed
        self._timing: list[_Copy] = []  # every copy whose duration has not been read yet

    def copy(self, slot: int, fill: Callable[[], None], keep: object) -> None:
        """Run `fill()` (which enqueues the slot's zeroing and copies) on the side stream."""
        compute = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # enqueued steps may still read this slot's old weights
            start.record(self.stream)
            fill()
            end.record(self.stream)
        c = _Copy(slot, start, end, keep)
        self._pending[slot] = c  # a later copy into the same slot is behind this one on the same stream
        self._timing.append(c)

    def done(self, slot: int) -> bool:
        """True when `slot` has no copy still running on the device (host-side query, no sync)."""
        c = self._pending.get(slot)
        if c is None:
            return True
        if c.end.query():
            del self._pending[slot]
            return True
        return False

    def wait(self, slots: Iterable[int]) -> None:
        """Make the compute stream wait for the copies into `slots` (device-side; free once completed)."""
        compute = torch.cuda.current_stream(self.device)
        for s in set(slots):
            c = self._pending.pop(s, None)
            if c is not None:
                compute.wait_event(c.end)

    @property
    def in_flight(self) -> int:
        """Copies enqueued and not yet completed."""
        return sum(not c.end.query() for c in self._timing)

    def finished_durations(self) -> list[float]:
        """Device durations (seconds) of the copies completed since the last call."""
        out, left = [], []
        for c in self._timing:
            if c.end.query():
                out.append(c.start.elapsed_time(c.end) / 1e3)
            else:
                left.append(c)
        self._timing = left
        return out
