"""The two-tenant fairness mix of `appliance bench serve --tenant-rate R` (docs/tenants.md, issue 35):
tenant A offers `--tenant-flood` (10) times its share while tenant B offers a steady load, and the
report says whether B notices.

Each tenant's share is R requests/s (equal weights, so equal shares): its `requests_per_s` limit, with a
bucket of max(4, R) requests, and half the engine's seats (`max_concurrent` = engine.max_num_seqs // 2).
B sends exactly its share, evenly spaced (a steady client; Poisson gaps at the bucket's own rate would
empty it by chance now and then); A sends flood x R, evenly spaced over the same time. Two phases per
adapter mix: B alone, then A and B together, with B's same arrival times and fresh prompts of the
same lengths (no prefix-cache hits on phase one's). The bench writes the tenants file (its own config
search path, `tenants=bench_fair`) with keys it makes per run, passed to the server in its
environment, and warms the server up with its own unscoped key. Every client process also sends one
request of its own first (a fresh process's first requests are slow: they would be the p99), then the
phase waits until both buckets are full again before it starts.

Each tenant is its own client (its own processes, as two teams' clients are): A's streams do not slow
the client that times B.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from appliance.bench.report import table
from appliance.bench.serve_client import ClientJob, HttpTarget, JobResult, RequestSpec, run_client_processes
from appliance.bench.serve_options import ServeOptions
from appliance.bench.serve_report import failures_text
from appliance.bench.serve_stats import counter_deltas, counter_samples, server_summary, summarize
from appliance.bench.workload import even_arrivals

FLOOD, STEADY = "bench-a", "bench-b"  # tenant names (metrics labels): A floods, B is steady
KEY_ENVS = {FLOOD: "APPLIANCE_BENCH_TENANT_A_KEY", STEADY: "APPLIANCE_BENCH_TENANT_B_KEY"}
GROUP_OPTION = "bench_fair"  # tenants/bench_fair.yaml on the bench's own search path
TARGET_RATIO = 1.5  # issue 35: B's p99 TTFT with A flooding, over B's alone
MIN_BURST = 4  # a steady client's sends bunch up when its event loop is late; the bucket absorbs it
COLUMNS = ["mix", "phase", "tenant", "offered_rps", "requests", "ok", "429", "other_failures", "ttft_p50",
           "ttft_p99", "itl_p99", "out_tok_s", "server_rejections", "queue_time_mean_ms"]


@dataclass(frozen=True)
class TenantPlan:
    """What each tenant offers and the limits that make R requests/s its share."""

    rate: float  # each tenant's share and B's steady offer, requests/s
    flood: float  # A's offer over its share
    burst: int  # each tenant's requests/s bucket
    max_concurrent: int  # each tenant's half of the engine's seats
    requests: int  # B's measured requests per phase; A sends flood x as many in the same time

    @classmethod
    def of(cls, opts: ServeOptions, max_num_seqs: int) -> "TenantPlan":
        return cls(opts.tenant_rate, opts.tenant_flood, max(MIN_BURST, math.ceil(opts.tenant_rate)),
                   max(1, max_num_seqs // 2), opts.num_requests)

    @property
    def flood_requests(self) -> int:
        return max(1, round(self.requests * self.flood))

    @property
    def specs_needed(self) -> int:
        """Distinct requests per mix: B alone, B with A, A."""
        return 2 * self.requests + self.flood_requests

    def tenants_yaml(self) -> str:
        limits = (f"{{requests_per_s: {self.rate:g}, burst: {self.burst}, max_concurrent: {self.max_concurrent}}}")
        return "".join(f"{name}:\n  keys: [\"${{oc.env:{KEY_ENVS[name]}}}\"]\n  adapters: [\"*\"]\n"
                       f"  allow_base: true\n  weight: 1\n  limits: {limits}\n" for name in (FLOOD, STEADY))


def server_setup(plan: TenantPlan, work_dir: Path, server_limit: int) -> tuple[list[str], dict[str, str], dict]:
    """Write `work_dir`/tenants/bench_fair.yaml; the server's overrides, its environment (a fresh key per
    tenant, never printed) and the keys by tenant. `server_limit`: server.max_concurrent_requests as
    composed, raised so that the two tenants' concurrency shares never reach it (B's 429s would then
    be the server's, not fairness)."""
    (work_dir / "tenants").mkdir(parents=True, exist_ok=True)
    (work_dir / "tenants" / f"{GROUP_OPTION}.yaml").write_text(plan.tenants_yaml())
    keys = {name: secrets.token_urlsafe(24) for name in KEY_ENVS}
    env = {KEY_ENVS[name]: key for name, key in keys.items()}
    overrides = [f"hydra.searchpath=['file://{work_dir.resolve()}']", f"tenants={GROUP_OPTION}"]
    need = 2 * plan.max_concurrent + 16  # + the bench's own warm-up and scrapes
    if server_limit and server_limit < need:
        overrides.append(f"server.max_concurrent_requests={need}")
    return overrides, env, keys


class TenantMix:
    """The two phases of every mix against a started server."""

    def __init__(self, plan: TenantPlan, targets: dict[str, HttpTarget], bench: HttpTarget, procs: int,
                 scrape: Callable[[], str]) -> None:
        self.plan, self.targets, self.bench, self.scrape = plan, targets, bench, scrape
        self.procs = max(1, procs // 2)  # client processes per tenant
        self.rows: list[dict] = []
        self.fairness: list[dict] = []

    def run(self, mix: str, specs: Sequence[RequestSpec], warm: Sequence[RequestSpec],
            progress: Callable[[str], None] = lambda s: None) -> None:
        p, n = self.plan, self.plan.requests
        alone, with_a, flood = specs[:n], specs[n:2 * n], specs[2 * n:p.specs_needed]
        steady = even_arrivals(n, p.rate)
        self._phase(mix, "alone", {STEADY: (alone, steady, p.rate)}, warm)
        progress(f"{mix}: B alone done")
        self._phase(mix, "mixed", {FLOOD: (flood, even_arrivals(len(flood), p.rate * p.flood), p.rate * p.flood),
                                   STEADY: (with_a, steady, p.rate)}, warm[:0])
        progress(f"{mix}: A flooding + B done")
        self.fairness.append(self._verdict(mix))

    def _phase(self, mix: str, phase: str, load: dict[str, tuple[Sequence[RequestSpec], list[float], float]],
               server_warm: Sequence[RequestSpec]) -> None:
        """`server_warm`: a wave on the bench's own key first (no tenant bucket touched)."""
        jobs: list[ClientJob] = []
        owners: list[Optional[str]] = []
        for name, (specs, arrivals, _) in load.items():
            for k in range(self.procs):
                jobs.append(ClientJob(self.targets[name], list(specs[k::self.procs]), [specs[k]], 0,
                                      arrivals[k::self.procs]))
                owners.append(name)
        if server_warm:
            jobs.append(ClientJob(self.bench, [], list(server_warm), len(server_warm)))
            owners.append(None)
        before: dict[str, float] = {}

        def measuring() -> None:
            time.sleep(self.plan.burst / self.plan.rate)  # the warm-ups' tokens back: both buckets full
            before.update(counter_samples(self.scrape()))

        got = run_client_processes(jobs, self.bench.timeout_s, measuring)
        deltas = counter_deltas(before, counter_samples(self.scrape()))
        for name, (specs, _, offered) in load.items():
            mine = [g for g, o in zip(got, owners) if o == name]
            self.rows.append(self._row(mix, phase, name, offered, specs, mine, deltas))

    def _row(self, mix: str, phase: str, name: str, offered: float, specs: Sequence[RequestSpec],
             got: list[JobResult], deltas: dict[str, float]) -> dict:
        results = [None] * len(specs)
        for k, g in enumerate(got):
            results[k::self.procs] = g.results
        wall = max(g.end for g in got) - min(g.start for g in got)
        s = summarize(results, wall, [x.output_len for x in specs])
        label = f'tenant="{name}"'
        rejections = {k.split('reason="')[1].split('"')[0]: v for k, v in deltas.items()
                      if k.startswith("appliance_tenant_rejections_total{") and label in k and v}
        q_sum = deltas.get(f"appliance_tenant_queue_time_seconds_sum{{{label}}}", 0.0)
        q_count = deltas.get(f"appliance_tenant_queue_time_seconds_count{{{label}}}", 0.0)
        return {"mix": mix, "phase": phase, "tenant": name, "offered_rps": round(offered, 3), **s,
                "client_cpu_util": round(max(g.cpu_util for g in got), 3),
                "server": {"admitted": deltas.get(f"appliance_tenant_requests_total{{{label}}}", 0.0),
                           "rejections": rejections,
                           "queue_time_mean_ms": round(1e3 * q_sum / q_count, 3) if q_count else None},
                # The whole server's counters over the phase (both tenants).
                "server_total": server_summary(deltas)}

    def _verdict(self, mix: str) -> dict:
        def row(phase: str, name: str) -> dict:
            return next(r for r in self.rows if (r["mix"], r["phase"], r["tenant"]) == (mix, phase, name))

        b1, b2, a = row("alone", STEADY), row("mixed", STEADY), row("mixed", FLOOD)
        p99 = [(r["ttft_ms"] or {}).get("p99") for r in (b1, b2)]
        ratio = round(p99[1] / p99[0], 3) if all(p99) else None
        b_fail = sum(b1["failures"].values()) + sum(b2["failures"].values())
        return {"mix": mix, "b_ttft_p99_alone_ms": p99[0], "b_ttft_p99_mixed_ms": p99[1],
                "b_ttft_p99_ratio": ratio, "target": TARGET_RATIO,
                "met": ratio is not None and ratio <= TARGET_RATIO and b_fail == 0,
                "b_429": b1["failures"].get("429", 0) + b2["failures"].get("429", 0), "b_failures": b_fail,
                "a_requests": a["requests"], "a_ok": a["ok"], "a_429": a["failures"].get("429", 0),
                "a_other_failures": sum(v for k, v in a["failures"].items() if k != "429")}

    def report(self) -> dict:
        return {"plan": {**asdict(self.plan), "flood_requests": self.plan.flood_requests,
                         "tenants": {"A": FLOOD, "B": STEADY}, "client_processes_per_tenant": self.procs},
                "rows": self.rows, "fairness": self.fairness}


def failed(res: dict) -> bool:
    """The run's exit status is 1 when B lost a request or A failed by anything but its 429s."""
    return any(f["b_failures"] or f["a_other_failures"] for f in res.get("fairness") or [])


def render(res: dict, model: str) -> str:
    """The mix's table and one verdict line per adapter mix (latencies in ms)."""
    p = res["plan"]
    head = (f"## bench serve: two-tenant mix on {model}: each tenant's share {p['rate']:g} req/s (burst "
            f"{p['burst']}, {p['max_concurrent']} concurrent), B steady at its share, A at {p['flood']:g}x; "
            f"{p['requests']} B requests per phase (latencies in ms)")

    def flat(r: dict) -> dict:
        def q(key: str, x: str) -> Optional[float]:
            return (r.get(key) or {}).get(x)

        other = {k: v for k, v in r["failures"].items() if k != "429"}
        return {**r, "tenant": "A" if r["tenant"] == FLOOD else "B", "429": r["failures"].get("429", 0),
                "other_failures": failures_text(other),
                "ttft_p50": q("ttft_ms", "p50"), "ttft_p99": q("ttft_ms", "p99"), "itl_p99": q("itl_ms", "p99"),
                "server_rejections": ", ".join(f"{k}: {v:g}" for k, v in r["server"]["rejections"].items()) or "0",
                "queue_time_mean_ms": r["server"]["queue_time_mean_ms"]}

    lines = [head, "", table([flat(r) for r in res["rows"]], COLUMNS), ""]
    for f in res["fairness"]:
        ratio = "n/a" if f["b_ttft_p99_ratio"] is None else f"{f['b_ttft_p99_ratio']:.2f}"
        lines.append(f"{f['mix']}: B p99 TTFT with A flooding / alone = {ratio} (target <= {f['target']:g}: "
                     f"{'met' if f['met'] else 'NOT met'}); B 429s {f['b_429']}, B failures {f['b_failures']}; "
                     f"A 429s {f['a_429']} of {f['a_requests']}")
    return "\n".join(lines)
