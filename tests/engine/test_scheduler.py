"""Scheduler policy in plain Python: budgets, FIFO admission, chunked prefill, preemption."""

from __future__ import annotations

import pytest

from appliance.config.schema import EngineConfig
from appliance.engine.block_manager import BlockManager
from appliance.engine.request import SamplingParams
from appliance.engine.scheduler import Scheduler, SchedulerOutput
from appliance.engine.sequence import Sequence, SeqStatus


def make(num_blocks: int = 100, block_size: int = 4, **cfg) -> Scheduler:
    return Scheduler(EngineConfig(**cfg), BlockManager(num_blocks, block_size))


def add(s: Scheduler, rid: str, n: int) -> Sequence:
    q = Sequence(rid, list(range(n)), SamplingParams(max_tokens=100), 0.0)
    s.add(q)
    return q


def fake_step(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the model ran: record computed tokens, append a sampled token."""
    samplers = [x.seq for x in out.prefills + out.decodes if x.samples]
    s.after_step(out)
    for q in samplers:
        q.output_token_ids.append(7)


def test_new_requests_join_running_batch_each_step() -> None:
    s = make()
    a = add(s, "a", 5)
    out = s.schedule()
    assert [x.seq for x in out.prefills] == [a] and out.prefills[0].num_new_tokens == 5
    fake_step(s, out)
    b = add(s, "b", 3)
    out = s.schedule()
    assert [x.seq for x in out.decodes] == [a] and [x.seq for x in out.prefills] == [b]


def test_token_budget_chunks_long_prompt() -> None:
    s = make(max_num_batched_tokens=4)
    a = add(s, "a", 10)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append(out.prefills[0].num_new_tokens)
        assert out.prefills[0].samples == (sum(chunks) == 10)
        fake_step(s, out)
    assert chunks == [4, 4, 2] and a.num_computed_tokens == 10 and len(a.output_token_ids) == 1


def test_no_chunking_waits_for_budget() -> None:
    s = make(max_num_batched_tokens=6, enable_chunked_prefill=False)
    add(s, "a", 4)
    add(s, "b", 4)
    out = s.schedule()
    assert [x.seq.request_id for x in out.prefills] == ["a"]


def test_max_num_seqs_limits_running() -> None:
    s = make(max_num_seqs=2)
    for r in "abc":
        add(s, r, 2)
    out = s.schedule()
    assert len(out.prefills) == 2 and [q.request_id for q in s.waiting] == ["c"]


def test_fifo_admission_when_blocks_run_out() -> None:
    s = make(num_blocks=3, block_size=4)
    add(s, "big", 12)  # takes all 3 blocks
    add(s, "small", 1)
    out = s.schedule()
    assert [x.seq.request_id for x in out.prefills] == ["big"]
    assert [q.request_id for q in s.waiting] == ["small"]


def test_preempts_newest_when_blocks_run_out_and_requeues_it_first() -> None:
    s = make(num_blocks=4, block_size=2)
    a, b = add(s, "a", 4), add(s, "b", 4)  # 2 blocks each: cache full
    fake_step(s, s.schedule())
    # Both now hold 5 tokens' worth of sequence and need a third block: b (newest) is preempted.
    out = s.schedule()
    assert out.preempted == [b]
    assert [x.seq for x in out.decodes] == [a]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b and b.output_token_ids == [7]  # generated tokens kept, recomputed later
    fake_step(s, out)
    s.remove(a)
    out = s.schedule()
    assert [x.seq for x in out.prefills] == [b] and out.prefills[0].num_new_tokens == 5


def test_lone_sequence_preempting_itself_does_not_loop() -> None:
    s = make(num_blocks=2, block_size=2)
    a = add(s, "a", 4)
    fake_step(s, s.schedule())
    out = s.schedule()  # needs a third block, none exists: it preempts itself, nothing runs
    assert out.preempted == [a] and out.empty


def test_remove_frees_waiting_and_running() -> None:
    s = make()
    a, b = add(s, "a", 3), add(s, "b", 3)
    s.schedule()
    s.remove(a)
    s.remove(b)
    assert s.bm.num_used == 0 and not s.has_unfinished()


def add_lora(s: Scheduler, rid: str, adapter: str) -> Sequence:
    q = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=100), 0.0, adapter=adapter)
    s.add(q)
    return q


def ids(out: SchedulerOutput) -> set[str]:
    return {x.seq.request_id for x in out.prefills + out.decodes}


def test_adapter_without_slot_waits_without_blocking_others() -> None:
    from appliance.lora.pool import SlotPool

    s = Scheduler(EngineConfig(), BlockManager(100, 4), SlotPool(1, "lru"))
    add_lora(s, "a1", "a")
    add_lora(s, "b1", "b")  # no slot left for b
    add(s, "base", 3)  # behind b in the queue, must still run
    add_lora(s, "a2", "a")  # resident adapter: runs too
    out = s.schedule()
    assert ids(out) == {"a1", "base", "a2"}
    assert out.slot_loads == [(0, "a")]
    assert [q.request_id for q in s.waiting] == ["b1"]


def test_adapter_not_ready_waits_for_load_without_blocking_or_taking_a_slot() -> None:
    """Overlap loading's gate: a request whose adapter is still being read waits (reason "load"),
    holds no slot, and base requests and ready adapters behind it run."""
    from appliance.lora.pool import SlotPool

    ready = {"a"}
    asked: list[str] = []

    def gate(key: str) -> bool:
        asked.append(key)
        return key in ready

    pool = SlotPool(2, "lru")
    s = Scheduler(EngineConfig(), BlockManager(100, 4), pool, adapter_ready=gate)
    add_lora(s, "c1", "cold")
    add(s, "base", 3)
    add_lora(s, "a1", "a")
    out = s.schedule()
    assert ids(out) == {"base", "a1"} and out.slot_loads == [(0, "a")]
    assert [q.request_id for q in s.waiting] == ["c1"] and s.waiting[0].wait_reason == "load"
    assert pool.lookup("cold") is None and s.waiting_by_reason()["load"] == 1
    assert asked == ["cold", "a"]
    ready.add("cold")  # the read ended
    out = s.schedule()
    assert ids(out) == {"c1", "base", "a1"} and out.slot_loads == [(1, "cold")]
    assert not s.waiting


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_drain_rule_stops_admitting_the_resident_adapter(threshold: float) -> None:
    from appliance.lora.pool import SlotPool

    now = [0.0]
    s = Scheduler(EngineConfig(), BlockManager(100, 4), SlotPool(1, "lru"),
                  drain_wait_threshold_s=threshold, clock=lambda: now[0])
    a1 = add_lora(s, "a1", "a")
    fake_step(s, s.schedule())
    b1 = add_lora(s, "b1", "b")
    fake_step(s, s.schedule())
    assert b1.slot_wait_since == 0.0
    now[0] = 2.0  # b has now waited longer than the threshold
    a2 = add_lora(s, "a2", "a")
    out = s.schedule()
    if threshold == 0.0:
        assert "a2" in ids(out)  # rule off: the resident adapter keeps its slot busy
        return
    assert "a2" not in ids(out) and s.draining == "a"
    fake_step(s, out)
    s.remove(a1)  # a's last running request ends: its slot frees and b gets it
    out = s.schedule()
    assert "b1" in ids(out) and out.slot_loads == [(0, "b")]
    assert a2.status is SeqStatus.WAITING


# ---------------------------------------------------------------------------------- stats for metrics

def test_waiting_reasons_kv_and_budget_and_queue_times() -> None:
    clock = iter(range(100, 200)).__next__
    s = Scheduler(EngineConfig(max_num_batched_tokens=8), BlockManager(3, 4), clock=lambda: float(clock()))
    a = add(s, "a", 8)  # takes 2 of 3 blocks and the whole token budget
    b = add(s, "b", 8)
    s.schedule()
    assert s.waiting_by_reason() == {"slot": 0, "kv": 0, "budget": 1, "load": 0} and b.wait_reason == "budget"
    assert s.stats.events.queue_times == [(None, a.first_scheduled_time - a.arrival_time)]
    s2 = Scheduler(EngineConfig(max_num_batched_tokens=64), BlockManager(3, 4))
    add(s2, "a", 8)
    c = add(s2, "c", 8)  # needs 2 blocks, 1 left
    s2.schedule()
    assert s2.waiting_by_reason() == {"slot": 0, "kv": 1, "budget": 0, "load": 0} and c.wait_reason == "kv"


def test_slot_waits_and_preemptions_are_recorded() -> None:
    from appliance.lora.pool import SlotPool

    now = [0.0]
    pool = SlotPool(1, "lru")
    s = Scheduler(EngineConfig(), BlockManager(100, 4), slots=pool, clock=lambda: now[0])
    a = Sequence("a", [1, 2], SamplingParams(max_tokens=5), 0.0, adapter="x@0", adapter_name="x")
    b = Sequence("b", [1, 2], SamplingParams(max_tokens=5), 0.0, adapter="y@1", adapter_name="y")
    s.add(a)
    s.add(b)
    s.schedule()  # a gets the only slot, b waits for it
    assert s.waiting_by_reason()["slot"] == 1 and s.stats.events.slot_waits == [0.0]
    now[0] = 2.5
    s.remove(a)
    s.schedule()
    assert s.stats.events.slot_waits == [0.0, 2.5]
    assert [q for q, _ in s.stats.events.queue_times] == ["x", "y"]
    events = s.stats.take()
    assert events.preemptions == 0 and s.stats.events.slot_waits == []


def test_parallel_samples_share_the_prompt_full_blocks() -> None:
    s = make(block_size=4, max_num_batched_tokens=64)
    a = add(s, "a", 10)  # blocks [0-3][4-7][8-9]: the first two are full and shared
    kids = [add(s, f"k{i}", 10) for i in range(3)]
    for k in kids:
        k.prompt_source = a
    out = s.schedule()
    assert [x.seq for x in out.prefills] == [a]  # the samples wait for its prompt
    assert all(k.wait_reason == "budget" and not k.block_table for k in kids)
    fake_step(s, out)
    out = s.schedule()
    shared = a.block_table[:2]
    for k in kids:
        assert k.block_table[:2] == shared and k.block_table[2] != a.block_table[2]
    assert [(x.seq, x.num_new_tokens) for x in out.prefills] == [(k, 2) for k in kids]
    assert s.bm.num_used == 2 + 4  # two shared blocks, four private last blocks
    fake_step(s, out)
    for q in [a, *kids]:
        s.remove(q)
    assert s.bm.num_used == 0  # ref counts: each shared block freed once, by its last owner


def test_a_sample_whose_source_finished_computes_the_prompt_alone() -> None:
    s = make(block_size=4)
    a = add(s, "a", 9)
    k = add(s, "k", 9)
    k.prompt_source = a
    fake_step(s, s.schedule())
    s.remove(a)
    out = s.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.prefills] == [(k, 9)] and k.prompt_source is None
