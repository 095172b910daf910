"""What one row of `appliance bench serve` reports: throughput and latency percentiles of its requests,
failures by HTTP status, and the deltas of the server's own /metrics counters over the row.

The counters are read with prometheus_client's parser from two scrapes (before the row's measured
requests, after them). Series are summed over their `adapter` label (up to metrics.max_adapter_labels
values each), so a row's deltas stay a short list whatever the adapter count.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Optional, Sequence

from appliance.bench.serve_client import Result
from appliance.bench.workload import percentile
from appliance.telemetry.stats import STEP_PATHS

PERCENTILES = (50, 90, 99)


def latency_ms(xs: Sequence[float]) -> Optional[dict]:
    """mean, p50, p90, p99 in ms (nearest rank); None without samples."""
    if not xs:
        return None
    out = {"mean": round(statistics.fmean(xs) * 1e3, 3)}
    out.update({f"p{p}": round(percentile(list(xs), p) * 1e3, 3) for p in PERCENTILES})
    return out


def summarize(results: Sequence[Result], wall_s: float, expected_tokens: Sequence[int]) -> dict:
    """The row's figures. expected_tokens[i]: the output length request i asked for (ignore_eos makes
    it exact; `output_len_mismatch` counts the successful requests that differ)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    # TPOT: a request's time per output token after the first (vLLM's definition).
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.output_tokens > 1 and r.e2e_s is not None and r.ttft_s is not None]
    errors: dict[str, str] = {}
    for r in results:
        if not r.ok:
            errors.setdefault(r.failure, r.error)
    return {
        "requests": len(results), "ok": len(ok),
        "failures": dict(sorted(Counter(r.failure for r in results if not r.ok).items())),
        "first_errors": errors,
        "wall_s": round(wall_s, 4),
        "req_s": round(len(ok) / wall_s, 4),
        "out_tok_s": round(out_tokens / wall_s, 3),
        "in_tok_s": round(sum(prompt) / wall_s, 3) if prompt else None,
        "output_tokens": out_tokens,
        "prompt_tokens_mean": round(statistics.fmean(prompt), 2) if prompt else None,
        "output_len_mismatch": sum(r.output_tokens != n for r, n in zip(results, expected_tokens) if r.ok),
        "ttft_ms": latency_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": latency_ms([x for r in ok for x in r.itl_s]),
        "tpot_ms": latency_ms(tpot),
        "e2e_ms": latency_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


# ------------------------------------------------------------------------------------------ /metrics

def counter_samples(text: str) -> dict[str, float]:
    """The cumulative samples of a Prometheus text page: counters (`*_total`) and histograms' `_count`
    and `_sum`, keyed `name{label="v",...}` with the `adapter` label summed away."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type not in ("counter", "histogram"):
            continue
        for s in fam.samples:
            if fam.type == "histogram" and not s.name.endswith(("_count", "_sum")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "adapter")
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for every series of `after` (a series new since `before` counts from 0)."""
    return {k: round(v - before.get(k, 0.0), 6) for k, v in sorted(after.items())}


def counter_total(deltas: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s series in `deltas` that carry every one of `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return round(sum(v for k, v in deltas.items() if k.split("{")[0] == name and all(w in k for w in want)), 6)


def server_summary(deltas: dict[str, float]) -> dict:
    """The few counters a reader looks for first, picked out of the deltas."""
    def total(prefix: str, **labels: str) -> float:
        return counter_total(deltas, prefix, **labels)

    slot_waits = total("appliance_lora_slot_wait_seconds_count")
    queried = total("appliance_prefix_cache_queries_total")
    return {
        "requests_by_reason": {r: total("appliance_requests_total", finish_reason=r)
                               for r in ("stop", "length", "abort", "error")},
        "generation_tokens": total("appliance_generation_tokens_total"),
        "prompt_tokens": total("appliance_prompt_tokens_total"),
        "preemptions": total("appliance_preemptions_total"),
        "slot_evictions": total("appliance_lora_evictions_total", tier="gpu"),
        "cpu_evictions": total("appliance_lora_evictions_total", tier="cpu"),
        "slot_loads": total("appliance_lora_loads_total", tier="gpu"),
        "cold_reads": total("appliance_lora_loads_total", tier="cpu"),
        "load_errors": total("appliance_lora_loads_total", result="error"),
        "slot_waits": slot_waits,
        "slot_wait_mean_ms": _mean_ms(total("appliance_lora_slot_wait_seconds_sum"), slot_waits),
        "queue_time_mean_ms": _mean_ms(total("appliance_request_queue_time_seconds_sum"),
                                       total("appliance_request_queue_time_seconds_count")),
        # Share of the admitted requests' tokens served from the prefix cache; None with it off.
        "prefix_cache_hit_ratio": round(total("appliance_prefix_cache_hits_total") / queried, 4) if queried else None,
        "prefix_cache_evictions": total("appliance_prefix_cache_evictions_total"),
        # How the engine ran its steps (a CUDA graph, piecewise graphs, eagerly) and their mean scheduled tokens.
        "steps_by_path": {p: total("appliance_engine_steps_total", path=p) for p in STEP_PATHS},
        "step_tokens_mean_by_path": {p: _mean(total("appliance_engine_step_tokens_sum", path=p),
                                              total("appliance_engine_step_tokens_count", path=p))
                                     for p in STEP_PATHS},
    }


def _mean_ms(total_s: float, count: float) -> Optional[float]:
    return round(1e3 * total_s / count, 3) if count else None


def _mean(total: float, count: float) -> Optional[float]:
    return round(total / count, 1) if count else None
