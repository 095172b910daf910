"""Online phase: open-loop load on the AsyncEngine (the server's engine front, in process).

Requests arrive as a Poisson process; each names an adapter drawn from a Zipf popularity over the
adapter set, so a few are hot and the long tail churns through the GPU slots (and the CPU tier when
lora.max_loaded_loras is below the set). We drive `AsyncEngine.generate` directly rather than HTTP on
loopback: the figures are then the engine's scheduling, slot churn and step times, without JSON and
HTTP costs, and it needs no tokenizer (a shape-only model works on token ids). The HTTP path is what
benchmarks/bench_cpu.py measures. Adapter loads during the measured run are counted from the engine's
own stats events: cold reads (disk -> CPU tier) and slot loads (CPU tier -> GPU slot), with durations.
The issue's target compares the churn's p99 TTFT with the same arrivals all on one adapter (`single`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from appliance.bench.offline import greedy
from appliance.bench.workload import percentile
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.engine import LLMEngine
from appliance.telemetry.stats import EngineEvents


@dataclass
class OnlineStats:
    ttft_s: list[float] = field(default_factory=list)  # arrival -> first token
    itl_s: list[float] = field(default_factory=list)  # gap between consecutive tokens of a request
    e2e_s: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: int = 0
    failures: int = 0
    first_error: str = ""


async def _drive(aeng: AsyncEngine, prompts: Sequence[list[int]], adapters: Sequence[Optional[str]],
                 arrivals: Sequence[float], new_tokens: int, progress: bool) -> tuple[OnlineStats, float]:
    from tqdm import tqdm

    st = OnlineStats()
    bar = tqdm(total=len(prompts), desc="online requests", disable=not progress, leave=False)

    async def one(i: int, t_arrive: float) -> None:
        last: Optional[float] = None
        n = 0
        try:
            async for out in aeng.generate(prompts[i], greedy(new_tokens), adapter=adapters[i]):
                now = time.perf_counter()
                k = len(out.token_ids)
                if k:
                    if last is None:
                        st.ttft_s.append(now - t_arrive)
                    else:  # several tokens in one update share its gap
                        st.itl_s.extend([(now - last) / k] * k)
                    last = now
                    n += k
            st.e2e_s.append(time.perf_counter() - t_arrive)
            st.tokens += n
            st.ok += 1
        except Exception as e:  # noqa: BLE001 - a failed request is a figure to report, not a crash
            st.failures += 1
            st.first_error = st.first_error or f"{type(e).__name__}: {e}"[:300]
        finally:
            bar.update(1)

    t0 = time.perf_counter()
    tasks = []
    for i, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, t0 + at)))
    await asyncio.gather(*tasks)
    bar.close()
    return st, time.perf_counter() - t0


def run_online(engine: LLMEngine, prompts: Sequence[list[int]], adapters: Sequence[Optional[str]],
               arrivals: Sequence[float], new_tokens: int, progress: bool = False,
               single: Optional[str] = None) -> dict:
    """Drive the load; return the summary (latencies in ms) and the raw TTFTs for the CDF plot.

    single: also run the very same arrivals and prompts with every request on this one adapter, on the
    same engine right after (no slot churn: it stays resident), under "single", and the ratio of the
    two p99 TTFTs as "ttft_p99_vs_single"."""
    from appliance.engine.kernel_variants import compiled_keys

    loads: dict[str, list[float]] = {"cpu": [], "gpu": [], "cpu_failed": [], "gpu_failed": []}

    def sink(ev: EngineEvents) -> None:  # engine thread
        for ld in ev.loads:
            loads[ld.tier if ld.ok else f"{ld.tier}_failed"].append(ld.duration_s)

    aeng = AsyncEngine(engine, stats_sink=sink)
    aeng.start()
    pool = engine.lora.pool if engine.lora is not None else None

    def measured(keys: Sequence[Optional[str]], show: bool) -> dict:
        asyncio.run(aeng.stats())  # hands the events so far (warm-up, startup loads) to the sink
        for v in loads.values():
            v.clear()
        ev0 = pool.evictions if pool is not None else 0
        k0 = compiled_keys()
        st, wall = asyncio.run(_drive(aeng, prompts, keys, arrivals, new_tokens, show))
        asyncio.run(aeng.stats())
        k1 = compiled_keys()
        new = None if k0 is None or k1 is None else k1 - k0
        out = _summary(st, wall, keys, loads, (pool.evictions - ev0) if pool is not None else 0,
                       None if new is None else len(new))
        if new:
            out["compiled_kernels"] = sorted(k[:4000] for k in new)  # what the warm-up missed
            for k in out["compiled_kernels"]:
                print(f"[bench] compiled during the run: {k}", file=sys.stderr)
        return out

    try:
        # Warm-up, not counted: first-step allocations (and, without engine.warmup, kernel compilation
        # of a few batch layouts).
        k = min(8, len(prompts))
        asyncio.run(_drive(aeng, prompts[:k], adapters[:k], [0.0] * k, 2, False))
        res = measured(adapters, progress)
        if single is not None:
            one = measured([single] * len(prompts), False)
            res["single"] = {**one, "adapter": single}
            res["ttft_p99_vs_single"] = round(res["ttft_p99_ms"] / one["ttft_p99_ms"], 3)
    finally:
        aeng.shutdown()
    res["overlap_loading"] = bool(engine.lora is not None and engine.cfg.lora.overlap_loading)
    return res


def _summary(st: OnlineStats, wall: float, adapters: Sequence[Optional[str]], loads: dict[str, list[float]],
             evictions: int, compiled: Optional[int]) -> dict:
    ms = lambda xs, p: round(percentile(xs, p) * 1e3, 2)  # noqa: E731
    return {
        "requests": len(adapters), "ok": st.ok, "failures": st.failures, "first_error": st.first_error,
        "distinct_adapters_used": len({a for a in adapters if a is not None}),
        "wall_s": round(wall, 3), "req_s": round(st.ok / wall, 3), "out_tok_s": round(st.tokens / wall, 2),
        "ttft_p50_ms": ms(st.ttft_s, 50), "ttft_p99_ms": ms(st.ttft_s, 99),
        "itl_p50_ms": ms(st.itl_s, 50), "itl_p99_ms": ms(st.itl_s, 99),
        "e2e_p50_ms": ms(st.e2e_s, 50), "e2e_p99_ms": ms(st.e2e_s, 99),
        "slot_evictions": evictions,
        "cold_reads": len(loads["cpu"]), "cold_read_p50_ms": ms(loads["cpu"], 50),
        "cold_read_max_ms": round(max(loads["cpu"], default=float("nan")) * 1e3, 2),
        "slot_loads": len(loads["gpu"]), "slot_load_p50_ms": ms(loads["gpu"], 50),
        "load_failures": len(loads["cpu_failed"]) + len(loads["gpu_failed"]),
        # Triton kernel variants compiled during the measured run (None: not countable, e.g. interpreter):
        # anything above 0 is a request that paid a first-seen compile.
        "compiled_during_run": compiled,
        "ttft_ms_all": [round(x * 1e3, 3) for x in st.ttft_s],
    }
