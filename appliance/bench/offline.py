"""Offline phases on one engine: throughput over a number of distinct adapters, the decode step against
its memory floor, and prefill throughput. All requests are submitted at once and stepped to completion;
greedy with ignore_eos, so every request produces exactly its max_tokens."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from appliance.bench.adapters import adapter_numel
from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from appliance.models.weights import hf_weight_shapes
from appliance.engine.kernel_variants import compiled_keys


@dataclass
class Run:
    tokens: list[list[int]]  # generated ids per request, in submission order
    wall_s: float  # first add_request to the last token
    steps: int
    ttft_s: list[float] = field(default_factory=list)


# Back-to-back decode blocks timed; step_ms is their median (one stalled step spoils one block).
B2B_BLOCKS = 3


def greedy(n: int, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **extra)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_requests(engine: LLMEngine, prompts: Sequence[list[int]], adapters: Sequence[Optional[str]],
                 new_tokens: int, desc: str = "", progress: bool = False) -> Run:
    """Submit every prompt at once (request i on adapters[i]) and step until all are done."""
    from tqdm import tqdm

    sync(engine.runner.device)
    t0 = time.perf_counter()
    ids = [f"{desc}-{i}-{t0}" for i in range(len(prompts))]
    for rid, p, a in zip(ids, prompts, adapters):
        engine.add_request(rid, p, greedy(new_tokens), adapter=a)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    steps = 0
    with tqdm(total=len(prompts) * new_tokens, desc=desc, unit="tok", disable=not progress, leave=False) as bar:
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.token_ids
                first.setdefault(o.request_id, time.perf_counter() - t0)
                bar.update(len(o.token_ids))
            steps += 1
    sync(engine.runner.device)
    return Run([out[r] for r in ids], time.perf_counter() - t0, steps, list(first.values()))


def throughput_row(run: Run, **labels: object) -> dict:
    n = sum(len(t) for t in run.tokens)
    return {**labels, "tokens": n, "wall_s": round(run.wall_s, 4), "tok_s": round(n / run.wall_s, 2),
            "steps": run.steps, "ttft_mean_ms": round(1e3 * statistics.mean(run.ttft_s), 2)}


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device (or RAM) copy speed in bytes/s, counting bytes read plus bytes written. On CUDA
    each copy is timed by events around it: a host clock around a ~1 ms copy adds the launch and the
    synchronisation (2 to 4 % here), which would lower the bandwidth and so flatter every floor."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(8):
        sync(device)
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev[0].record()
            dst.copy_(src)
            ev[1].record()
            ev[1].synchronize()
            dt = ev[0].elapsed_time(ev[1]) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
        if i >= 2:  # the first copies fault pages in
            times.append(dt)
    return 2 * src.numel() * 4 / statistics.median(times)


def decode_step(engine: LLMEngine, prompts: Sequence[list[int]], adapters: Sequence[Optional[str]],
                steps: int, copy_bw: float, rank: int, targets: Sequence[str], progress: bool = False,
                profile: bool = False, variant: str = "plain", sampling: Optional[dict] = None) -> dict:
    """Prefill len(prompts) sequences, then time pure decode steps of all of them together: B2B_BLOCKS
    blocks of `steps` steps back to back (step_ms: the median of the blocks' mean step, what a serving
    loop gets; with async scheduling the host's work for a step overlaps the device's run of the one
    before; step_ms_blocks: each block's mean, so one stalled step shows as one outlier block, not as
    the figure), then `steps` steps each read and synchronised before the next starts
    (step_ms_serial: their median, host and device one after the other, as without async scheduling).
    compiled_during: Triton variants compiled while timing (a warm-up miss; their names in
    compiled_kernels).

    floor = bytes one decode step must read (weights except the embedding table, KV of every sequence,
    the A/B of each distinct adapter) / copy bandwidth measured in the same run. profile: 2 more steps
    under torch.profiler; the 24 kernels of most device time per step go to "top_kernels". sampling: extra
    SamplingParams fields of every row (logprobs; a grammar, compiled before the timing, restarting when
    complete since EOS is ignored), named by `variant` in the result."""
    from tqdm import tqdm

    dev = engine.runner.device
    ids = [f"dec-{i}-{time.perf_counter()}" for i in range(len(prompts))]
    # Sequences that finish their prefill early decode while the others prefill (at most one step each
    # per sequence still prefilling), so max_tokens leaves room for that and for the timed steps.
    for rid, p, a in zip(ids, prompts, adapters):
        engine.add_request(rid, p, greedy((B2B_BLOCKS + 1) * steps + len(prompts) + 8, **(sampling or {})),
                           adapter=a)
    serial, blocks = [], []
    k0 = compiled_keys()
    try:
        started: set[str] = set()
        while len(started) < len(ids):  # prefill (chunked) until every sequence has its first token
            for o in engine.step():
                started.add(o.request_id)
        engine.settle()
        bar = tqdm(total=(B2B_BLOCKS + 1) * steps, desc="decode steps", disable=not progress, leave=False)
        for _ in range(B2B_BLOCKS):
            sync(dev)
            t0 = time.perf_counter()
            got = 0
            for _ in range(steps):
                got += sum(len(o.token_ids) for o in engine.step())
                bar.update()
            got += sum(len(o.token_ids) for o in engine.settle())
            sync(dev)
            blocks.append((time.perf_counter() - t0) / steps)
            if got != steps * len(ids):
                raise RuntimeError(f"{steps} decode steps of {len(ids)} sequences gave {got} tokens")
        for _ in range(steps):
            sync(dev)
            t0 = time.perf_counter()
            outs = engine.step() + engine.settle()
            sync(dev)
            serial.append(time.perf_counter() - t0)
            bar.update()
            if len(outs) != len(ids):
                raise RuntimeError(f"a decode step advanced {len(outs)} of {len(ids)} sequences")
        bar.close()
        k1 = compiled_keys()
        prof = _profile_steps(engine, 2) if profile else None
    finally:
        for rid in ids:
            engine.abort(rid)
    a = engine.runner.args
    elt = torch.finfo(engine.runner.dtype).bits // 8
    shapes = hf_weight_shapes(a)
    weights = sum(_numel(s) for k, s in shapes.items() if k != "model.embed_tokens.weight" or a.tie_word_embeddings)
    weights += len(ids) * a.hidden_size  # the embedding rows looked up
    ctx = statistics.mean(len(p) for p in prompts) + 1 + B2B_BLOCKS * steps / 2  # mean context, timed blocks
    kv = len(ids) * ctx * 2 * a.num_layers * a.kv_size
    distinct = {x for x in adapters if x is not None}
    lora = len(distinct) * adapter_numel(a, rank, targets)
    floor_s = (weights + kv + lora) * elt / copy_bw
    step_s = statistics.median(blocks)
    new = None if k0 is None or k1 is None else sorted(k1 - k0)
    return {"variant": variant, "batch": len(ids), "context": len(prompts[0]), "adapters": len(distinct), "rank": rank if distinct else 0,
            "step_ms": round(step_s * 1e3, 3), "step_ms_blocks": [round(b * 1e3, 3) for b in blocks],
            "step_ms_serial": round(statistics.median(serial) * 1e3, 3),
            "compiled_during": None if new is None else len(new), **({"compiled_kernels": new} if new else {}),
            "async_scheduling": engine.async_scheduling,
            "weight_gb": round(weights * elt / 1e9, 3), "kv_gb": round(kv * elt / 1e9, 3),
            "adapter_gb": round(lora * elt / 1e9, 3), "adapter_bytes": int(lora * elt),
            "floor_ms": round(floor_s * 1e3, 4),
            "x_floor": round(step_s / floor_s, 2), **(prof if prof is not None else {})}


def _profile_steps(engine: LLMEngine, steps: int) -> dict:
    """Device time per step of the kernels that take most of it, "top_kernels": [{name, us_per_step,
    calls_per_step}], and over every kernel, "kernels_per_step" and "kernel_us_per_step" (what the
    step's launches add up to: the part that is not bytes shows as many short kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.runner.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        engine.settle()
        sync(engine.runner.device)
    rows = []
    n_kernels, kernel_us = 0, 0.0
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if dev_us > 0:
            rows.append({"name": e.key[:90], "us_per_step": round(dev_us / steps, 1),
                         "calls_per_step": e.count / steps})
        if getattr(e, "device_type", None) == DeviceType.CUDA:  # the kernels themselves, not the CPU ops
            n_kernels += e.count
            kernel_us += dev_us
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"top_kernels": rows[:24], "kernels_per_step": n_kernels / steps,
            "kernel_us_per_step": round(kernel_us / steps, 1)}


def prefill(engine: LLMEngine, prompts: Sequence[list[int]], adapters: Sequence[Optional[str]],
            label: str, progress: bool = False) -> dict:
    """Prompt tokens per second of len(prompts) requests that each generate one token."""
    run = run_requests(engine, prompts, adapters, 1, desc=f"prefill {label}", progress=progress)
    n = sum(len(p) for p in prompts)
    return {"label": label, "adapters": len({x for x in adapters if x is not None}), "requests": len(prompts),
            "prompt_len": len(prompts[0]), "prompt_tokens": n, "wall_s": round(run.wall_s, 4),
            "prefill_tok_s": round(n / run.wall_s, 1)}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
