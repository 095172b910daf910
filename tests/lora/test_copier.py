"""lora/copier.py's copy thread on CPU, through a fake of its stream/event seam (CudaOps): a copy is
done only once packed, enqueued and its end event completed; staging buffers come back to the pool
after their copy completed and are reused (never allocated again); copies into one slot land in order;
`wait` before the thread enqueued blocks until it did; a failed copy is reported, never done. Then the
real engine with this copier (the CUDA path's code on CPU) gives the tokens of the synchronous twin."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from appliance.lora.copier import SlotCopier
from appliance.lora.layers import load_adapter_into_slot
from appliance.lora.staging import SlotImage, StagingPool
from tests.lora.test_overlap_loading import ov_adapters  # noqa: F401 - the fixture
from tests.lora.test_staging import MAX_RANK, adapter, context

ALL = ("q_proj", "k_proj", "v_proj", "down_proj")


class FakeEvent:
    def __init__(self, ops: "FakeOps") -> None:
        self.ops = ops
        self.fired = threading.Event()

    def record(self, stream: "FakeStream") -> None:
        if stream.manual:
            with self.ops.lock:
                self.ops.recorded.append(self)
        else:
            self.fired.set()

    def query(self) -> bool:
        return self.fired.is_set()

    def synchronize(self) -> None:
        assert self.fired.wait(10), "event never completed"

    def elapsed_time(self, end: "FakeEvent") -> float:
        return 2.0  # ms


class FakeStream:
    def __init__(self, manual: bool) -> None:
        self.manual = manual  # events recorded on it complete when the test says (FakeOps.complete)
        self.waited: list[FakeEvent] = []

    def wait_event(self, e: FakeEvent) -> None:
        self.waited.append(e)


class FakeOps:
    """The side stream's events complete on `complete()` (or at once with `auto`); the compute stream's at once."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.lock = threading.Lock()
        self.recorded: list[FakeEvent] = []
        self.compute = FakeStream(manual=False)

    def stream(self) -> FakeStream:
        return FakeStream(manual=not self.auto)

    def event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent(self)

    def current(self) -> FakeStream:
        return self.compute

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        yield

    def enter_thread(self) -> None:
        pass

    def complete(self) -> int:
        with self.lock:
            done, self.recorded = self.recorded, []
        for e in done:
            e.fired.set()
        return len(done)


def until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


ALLOCATED: list[int] = []  # staging buffers made, by every pool of these tests


def copier(buffers: int, auto: bool = False) -> tuple[SlotCopier, FakeOps, Any, StagingPool]:
    ctx = context()
    image = SlotImage(ctx)

    def alloc() -> torch.Tensor:
        ALLOCATED.append(image.numel)
        return torch.empty(image.numel, dtype=image.dtype)

    pool = StagingPool(buffers, image.numel, image.dtype, pin=False, alloc=alloc)
    ops = FakeOps(auto)
    return SlotCopier(image, pool, ops), ops, ctx, pool


def test_copy_is_done_after_its_events_and_gives_its_buffer_back() -> None:
    c, ops, ctx, pool = copier(2)
    weights = adapter(0, 3, ALL)
    want = context()
    load_adapter_into_slot(want, 1, weights)
    c.copy(1, "a@0", weights)
    assert not c.done(1) and c.in_flight == 1
    until(lambda: len(ops.recorded) == 2, "start and end events recorded on the side stream")
    assert not c.done(1) and pool.free == 1  # enqueued, not completed: its buffer is still being read
    assert len(c.stream.waited) == 1 and c.stream.waited[0].query()  # the side stream waited on `after`
    ops.complete()
    until(lambda: pool.free == 2, "buffer back once the copy completed")
    assert c.done(1) and c.in_flight == 0
    assert c.finished_durations() == [0.002] and c.failures() == []
    for key, w in ctx.wrappers.items():
        assert torch.equal(w.A, want.wrappers[key].A) and torch.equal(w.B, want.wrappers[key].B), key
    c.close()


def test_more_copies_than_buffers_wait_for_one_and_land_in_order() -> None:
    c, ops, ctx, pool = copier(1)
    made = len(ALLOCATED)
    seq = [adapter(s, MAX_RANK if s % 2 else 2, ALL) for s in range(3)]
    for s, w in enumerate(seq):
        c.copy(0, f"k@{s}", w)  # all into slot 0: the last one must win
    until(lambda: len(ops.recorded) == 2, "first copy enqueued")
    time.sleep(0.05)
    assert len(ops.recorded) == 2  # the second waits for the only buffer
    for _ in range(3):
        until(lambda: len(ops.recorded) == 2, "next copy enqueued")
        ops.complete()
    until(lambda: pool.free == 1, "buffer back")
    assert c.done(0) and c.in_flight == 0 and len(ALLOCATED) == made  # 3 copies, no buffer made after start
    want = context()
    load_adapter_into_slot(want, 0, seq[-1])
    for key, w in ctx.wrappers.items():
        assert torch.equal(w.A, want.wrappers[key].A) and torch.equal(w.B, want.wrappers[key].B), key
    c.close()


def test_wait_blocks_until_enqueued_then_waits_on_the_device() -> None:
    c, ops, ctx, pool = copier(1)
    gate = threading.Event()
    pack = c.image.pack

    def slow_pack(buf: torch.Tensor, weights: Any) -> None:
        gate.wait(10)
        pack(buf, weights)

    c.image.pack = slow_pack  # type: ignore[method-assign]
    c.copy(2, "a@0", adapter(0, 4, ALL))
    threading.Timer(0.1, gate.set).start()
    t0 = time.monotonic()
    c.wait([2])  # must not return before the end event exists
    assert time.monotonic() - t0 >= 0.05
    assert ops.compute.waited and ops.compute.waited[-1] in ops.recorded  # the copy's end event
    ops.complete()
    c.close()


def test_failed_copy_is_reported_and_never_done() -> None:
    c, ops, ctx, pool = copier(1)

    def broken(buf: torch.Tensor, weights: Any) -> None:
        raise RuntimeError("boom")

    c.image.pack = broken  # type: ignore[method-assign]
    c.copy(1, "a@0", adapter(0, 4, ALL))
    until(lambda: c.enqueued(1) is not None, "failure recorded")
    ops.complete()
    until(lambda: pool.free == 1, "buffer back after a failure")
    assert not c.done(1) and c.in_flight == 0 and c.finished_durations() == []
    assert c.failures() == [(1, "a@0", "RuntimeError: boom")]
    assert c.done(1) and c.failures() == []  # forgotten once reported
    with pytest.raises(RuntimeError, match="boom"):
        c.copy(1, "a@1", adapter(0, 4, ALL))
        c.wait([1])  # a step about to use a slot whose copy failed: the step fails, not the slot's data
    ops.complete()
    until(lambda: pool.free == 1, "buffer back")
    c.close()


def test_engine_with_the_threaded_copier_gives_the_synchronous_tokens(ov_adapters: dict[str, Path],
                                                                     tiny_model_dir: Path) -> None:
    """The CUDA path (reserve ahead, copy thread, staging buffers, device-side wait) on CPU with the fake
    events: every adapter, cold or warm, reaches its slot through the copier, and each request's tokens
    equal the engine without overlap loading."""
    from tests.lora.test_overlap_loading import SHORT, drain, overlap_engine, reference

    engine = overlap_engine(tiny_model_dir, ov_adapters, "debug.fault_injection_read_delay_s=0")
    lora = engine.lora
    image = SlotImage(lora.ctx)
    pool = StagingPool(2, image.numel, image.dtype, pin=False)
    lora.copier = SlotCopier(image, pool, FakeOps(auto=True))
    enc = engine.tokenizer.encode
    from tests.lora.test_lora_engine import PROMPTS

    names = ["x", "y", "z", "x", "y"]
    for i, n in enumerate(names):
        engine.add_request(f"r{i}", enc(PROMPTS[i % len(PROMPTS)]), SHORT, adapter=n)
    res: dict[str, list[int]] = {}
    drain(engine, res, {})
    until(lambda: pool.free == 2, "every staging buffer back")
    lora.poll_loads()
    gpu = [ld for ld in lora.stats.take().loads if ld.tier == "gpu"]
    assert len(gpu) >= 3 and all(ld.ok for ld in gpu)  # x, y, z each went through the copier
    for i, n in enumerate(names):
        assert res[f"r{i}"] == reference(tiny_model_dir, ov_adapters, n, i % len(PROMPTS), SHORT), (i, n)
    lora.close()
