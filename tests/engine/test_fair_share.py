"""Weighted fair admission (engine/fair_share.py) in the real Scheduler, simulated step by step (no
torch, no wall clock): a tenant flooding the queue waits behind its own share, a steady tenant is
admitted ahead of the flood's backlog, weights set the split, and one flow stays FIFO."""

from __future__ import annotations

from typing import Optional

from appliance.config.schema import EngineConfig
from appliance.engine.block_manager import BlockManager
from appliance.engine.fair_share import FairShare, Share
from appliance.engine.request import SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import Sequence

A, B = Share("a", 1.0), Share("b", 1.0)
LENGTH = 8  # decode steps each request runs
SEATS = 4  # engine.max_num_seqs


class Sim:
    """The scheduler over `steps`: requests arrive per step, run LENGTH tokens, then finish."""

    def __init__(self) -> None:
        self.s = Scheduler(EngineConfig(max_num_seqs=SEATS, max_num_batched_tokens=4096), BlockManager(10_000, 16))
        self.step = 0
        self.arrived: dict[str, int] = {}
        self.admitted: dict[str, int] = {}
        self.order: list[str] = []
        self._n = 0

    def add(self, share: Optional[Share], prompt: int = 8) -> str:
        rid = f"{share.tenant if share else 'none'}{self._n}"
        self._n += 1
        seq = Sequence(rid, list(range(prompt)), SamplingParams(max_tokens=LENGTH, ignore_eos=True), float(self.step),
                       share=share)
        self.s.add(seq)
        self.arrived[rid] = self.step
        return rid

    def run_step(self) -> None:
        out = self.s.schedule()
        for x in out.prefills:
            if x.seq.request_id not in self.admitted:
                self.admitted[x.seq.request_id] = self.step
                self.order.append(x.seq.request_id)
        samplers = [x.seq for x in out.prefills + out.decodes if x.samples]
        self.s.after_step(out)
        for q in samplers:
            q.output_token_ids.append(7)
            if len(q.output_token_ids) >= LENGTH:
                self.s.remove(q)
        self.step += 1

    def waits(self, prefix: str) -> list[int]:
        return [self.admitted[r] - self.arrived[r] for r in self.admitted if r.startswith(prefix)]


def flood_and_steady(shares: bool, steps: int = 60) -> Sim:
    """A sends 10x its share at once (a backlog of 40 requests on 4 seats), then B sends one request
    every LENGTH steps (a quarter of the seats: well under half, its fair share)."""
    sim = Sim()
    for _ in range(40):
        sim.add(A if shares else None)
    for i in range(steps):
        if i % LENGTH == 0 and i < 48:
            sim.add(B if shares else None)
        sim.run_step()
    return sim


def test_steady_tenant_is_admitted_ahead_of_a_flood_backlog() -> None:
    fair = flood_and_steady(shares=True)
    b = fair.waits("b")
    assert len(b) == 6
    # Each of B's requests takes the next seat that frees: it waits at most one request's length,
    # whatever A has queued. B alone would take a free seat at once; A's running requests hold the
    # seats, so the first seat turnover is the bound, not A's backlog.
    assert max(b) <= LENGTH
    for rid in (r for r in fair.admitted if r.startswith("b")):
        waiting_a = [r for r in fair.arrived if r.startswith("a") and fair.arrived[r] <= fair.arrived[rid]
                     and fair.admitted.get(r, 10**9) > fair.admitted[rid]]
        assert waiting_a, "B should jump A's backlog, not follow it"
    # The same traffic without tenants (one FIFO flow) puts B behind the whole backlog.
    fifo = flood_and_steady(shares=False, steps=120)
    first_b = "none40"  # B's first request, after A's 40
    assert fifo.order.index(first_b) == 40
    assert fifo.admitted[first_b] - fifo.arrived[first_b] >= 40 // SEATS * LENGTH - LENGTH


def test_weights_split_admissions_when_both_flood() -> None:
    sim = Sim()
    heavy, light = Share("heavy", 2.0), Share("light", 1.0)
    for _ in range(60):
        sim.add(light)
        sim.add(heavy)
    for _ in range(24 * LENGTH // SEATS):
        sim.run_step()
    first = sim.order[:24]
    assert sum(r.startswith("heavy") for r in first) == 16  # 2:1
    assert sum(r.startswith("light") for r in first) == 8


def test_one_flow_is_fifo_and_preempted_requests_keep_their_place() -> None:
    sim = Sim()
    ids = [sim.add(None, prompt=4 + i % 3) for i in range(12)]
    while len(sim.order) < 12:
        sim.run_step()
    assert sim.order == ids


def test_tags() -> None:
    f = FairShare()
    assert [f.tag(A, 10) for _ in range(3)] == [0.0, 10.0, 20.0]  # a's backlog lines up
    assert f.tag(B, 10) == 0.0  # b starts at the virtual time
    assert f.tag(Share("c", 2.0), 10) == 0.0 and f.tag(Share("c", 2.0), 10) == 5.0  # weight 2: half the cost
    f.admitted(10.0)
    assert f.tag(Share("d"), 4) == 10.0
    f.admitted(30.0)
    f.forget_idle()
    assert f.tag(A, 1) == 30.0  # a's finish tag (30) was not ahead of the virtual time: dropped
