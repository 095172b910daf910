"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step has a token budget (max_num_batched_tokens) and a sequence budget (max_num_seqs). Running
sequences go first, oldest first (a decode token, or the next prompt chunk); then waiting ones in
weighted fair order across tenants (engine/fair_share.py; arrival order with one flow) while budgets
and KV blocks last. Out of blocks, the newest running sequence is
preempted to the front of the queue and recomputed later; nothing is dropped. `adapter_ready` keeps a
request whose adapter is still loading waiting (reason "load"). A pending async token
(`Sequence.num_pending`) counts, so the next step decodes on it. A sample with a `prompt_source` (`n`)
waits until that sequence computed the prompt's full blocks, then shares them and computes only the
rest, its own partial last block included: no block is written by two sequences. With prefix caching
a waiting request first takes the cached blocks of its prefix (BlockManager.match) and only its
uncached tokens count against the token budget. Pure Python, no torch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol

from appliance.config.schema import EngineConfig
from appliance.engine.block_manager import BlockManager
from appliance.engine.fair_share import FairShare
from appliance.engine.sequence import Sequence, SeqStatus
from appliance.telemetry.stats import WAIT_REASONS, StatsRecorder, WaitReason


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for this sequence in this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last known token, so it yields a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Slots(Protocol):
    """What the scheduler needs of the LoRA slot pool (appliance/lora/pool.py)."""

    def acquire(self, name: str) -> Optional[object]: ...

    def release(self, name: str) -> object: ...

    def lookup(self, name: str) -> Optional[int]: ...

    def drain_victim(self, waiting_since: Mapping[str, float], now: float, threshold_s: float,
                     current: Optional[str] = None) -> Optional[str]: ...


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)  # more than one new token, or first pass
    decodes: list[ScheduledSeq] = field(default_factory=list)  # exactly one new token, cache warm
    preempted: list[Sequence] = field(default_factory=list)
    # (slot, adapter key) pairs newly assigned this step: their weights must be in the slot before running.
    slot_loads: list[tuple[int, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager, slots: Optional[Slots] = None,
                 drain_wait_threshold_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 stats: Optional[StatsRecorder] = None,
                 adapter_ready: Optional[Callable[[str], bool]] = None) -> None:
        self.cfg = cfg
        # lora.overlap_loading: LoRAManager.adapter_ready (may start a background read; False = wait).
        self.adapter_ready = adapter_ready
        # Queue times, slot waits and preemptions are recorded here (the engine passes its recorder).
        self.stats = stats if stats is not None else StatsRecorder()
        self.bm = block_manager
        self.slots = slots
        self.drain_wait_threshold_s = drain_wait_threshold_s
        self.clock = clock
        # Adapter whose new requests are held back so its slot frees for one that waited too long.
        self.draining: Optional[str] = None
        self.waiting: deque[Sequence] = deque()  # in fair-share tag order (FIFO with one flow)
        self.fair = FairShare()
        self.running: list[Sequence] = []  # admission order: index 0 is the oldest
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        if not self.waiting:
            self.fair.forget_idle()
        seq.fair_tag = self.fair.tag(seq.share, len(seq.prompt_token_ids) + seq.params.max_tokens)
        k = len(self.waiting)
        while k > 0 and self.waiting[k - 1].fair_tag > seq.fair_tag:
            k -= 1  # ahead of a flooding tenant's backlog: its tags lie further in virtual time
        self.waiting.insert(k, seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks and adapter slot."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release_slot(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_by_reason(self) -> dict[str, int]:
        """Waiting requests by why the last schedule left them waiting (stats.WAIT_REASONS); a request
        added since then counts as "budget" (it waits for the next step)."""
        out = {r: 0 for r in WAIT_REASONS}
        for seq in self.waiting:
            out[seq.wait_reason or "budget"] += 1
        return out

    def adapter_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Distinct adapter names (sorted) of the running and of the waiting requests."""
        return (tuple(sorted({s.adapter_name for s in self.running if s.adapter_name is not None})),
                tuple(sorted({s.adapter_name for s in self.waiting if s.adapter_name is not None})))

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = 0 if seq.finishing else min(seq.num_uncomputed, budget)
            if n <= 0:
                i += 1
                continue
            # Make room: preempt the newest running sequences until this one's blocks fit.
            while not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself: everything newer is gone too
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        # Admit only when nobody was preempted this step (else we thrash); a sequence without a slot
        # stays waiting and the scan goes on, so base and resident-adapter requests are not blocked.
        self._update_drain()
        j = 0
        # Why the scan below stops; the waiting requests it never reaches are held up by the same thing.
        # A preemption this step means the KV cache ran out.
        stopped_by: WaitReason = "kv" if out.preempted else "budget"
        while (not out.preempted and j < len(self.waiting) and budget > 0
               and len(self.running) < self.cfg.max_num_seqs):
            seq = self.waiting[j]
            if seq.prompt_source is not None and not self._share_prompt(seq):
                seq.wait_reason = "budget"  # behind the sample that computes the shared prompt
                j += 1
                continue
            cached = self.bm.match(seq)  # prefix caching: its longest cached prefix of full blocks
            hit = len(cached) * self.bm.block_size
            n = seq.num_uncomputed - hit  # only the uncached tokens take from the budget
            if n > budget:
                if not self.cfg.enable_chunked_prefill:
                    break
                n = budget
            if not self.bm.can_allocate(seq, seq.num_computed_tokens + hit + n, cached):
                stopped_by = "kv"
                break  # FIFO for KV blocks: a later, smaller request must not starve this one
            if seq.adapter is not None and self.adapter_ready is not None and not self.adapter_ready(seq.adapter):
                seq.wait_reason = "load"  # its weights are on their way; base and ready requests go on
                if seq.load_wait_start is None:
                    seq.load_wait_start = self.clock()
                j += 1
                continue
            if seq.load_wait_start is not None and seq.load_wait_end is None:
                seq.load_wait_end = self.clock()  # its weights are ready now
            if seq.adapter is not None and self.slots is not None:
                got = None if seq.adapter == self.draining else self.slots.acquire(seq.adapter)
                if got is None:
                    now = self.clock()
                    if seq.slot_wait_since is None and seq.adapter != self.draining:
                        seq.slot_wait_since = now
                    if seq.slot_refused_at is None:
                        seq.slot_refused_at = now
                    seq.wait_reason = "slot"
                    j += 1
                    continue
                seq.slot_wait_since = None
                refused_at, seq.slot_refused_at = seq.slot_refused_at, None
                self.stats.events.slot_waits.append(0.0 if refused_at is None else self.clock() - refused_at)
                if got.needs_load:  # type: ignore[attr-defined]
                    out.slot_loads.append((got.slot, seq.adapter))  # type: ignore[attr-defined]
            del self.waiting[j]
            self.fair.admitted(seq.fair_tag)
            seq.wait_reason = None
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
                self.stats.events.queue_times.append((seq.adapter_name,
                                                      seq.first_scheduled_time - seq.arrival_time))
            if self.bm.cache is not None and not seq.block_table:
                self.stats.events.prefix_cache_lookups.append((seq.adapter_name, seq.num_tokens, hit))
            self.bm.allocate(seq, seq.num_computed_tokens + hit + n, cached)
            seq.num_computed_tokens += hit
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n

        for k in range(j, len(self.waiting)):
            self.waiting[k].wait_reason = stopped_by
        for s in scheduled:
            if s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0:
                out.decodes.append(s)
            else:
                out.prefills.append(s)
        return out

    def _share_prompt(self, seq: Sequence) -> bool:
        """Share the prompt's full blocks with `seq` once its source computed them; False = wait."""
        src = seq.prompt_source
        assert src is not None
        full = (len(seq.prompt_token_ids) - 1) // self.bm.block_size  # the last token's block stays its own
        if src.status is SeqStatus.FINISHED or full == 0:
            seq.prompt_source = None  # nothing to share (any more): compute the prompt alone
            return True
        if src.status is not SeqStatus.RUNNING or src.num_computed_tokens < full * self.bm.block_size:
            return False
        self.bm.share(seq, src, full)
        seq.num_computed_tokens = full * self.bm.block_size
        seq.prompt_source = None
        return True

    def _update_drain(self) -> None:
        """Drain rule (lora.drain_wait_threshold_s): once a request waited too long for a slot, stop
        admitting new requests of one resident unpinned adapter so that its slot frees."""
        if self.slots is None or self.drain_wait_threshold_s <= 0:
            return
        if self.draining is not None and self.slots.lookup(self.draining) is None:
            self.draining = None  # its slot went to someone else: done
        since: dict[str, float] = {}
        for q in self.waiting:
            if q.slot_wait_since is not None and q.adapter is not None:
                since[q.adapter] = min(since.get(q.adapter, q.slot_wait_since), q.slot_wait_since)
        self.draining = self.slots.drain_victim(since, self.clock(), self.drain_wait_threshold_s,
                                                current=self.draining)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.adapter is not None and self.slots is not None:
            self.slots.release(seq.adapter)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_slot(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.stats.events.preemptions += 1

    def after_step(self, out: SchedulerOutput) -> None:
        """Record that the scheduled tokens are now in the cache (call before appending sampled tokens)."""
        for s in out.prefills + out.decodes:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.bm.cache_computed(s.seq)
