"""Where a mixed step's time goes: one prefill chunk beside a running decode batch (issue 35).

Under open-loop arrivals nearly every step carries a new request's prefill, so it runs eagerly, not as
a decode CUDA graph. This builds the engine of the given overrides, starts `--decode` sequences (base
or spread over `--adapters` synthetic adapters), then times, per case, steps that add one new
`--prefill-len`-token request each (host wall time to the sampled tokens) against the decode-only
steps between them, and profiles one mixed step: host time per stage, the kernels it launches, the
CPU ops that take the most host time, and any host sync it makes (torch.cuda.set_sync_debug_mode).

Steps whose tokens fit engine.piecewise_graph_tokens run as piecewise CUDA graphs (engine/piecewise.py);
`--paths both` (default) runs every case that way and again with those steps eager, in one engine.

    python benchmarks/mixed_step_gpu.py [--decode 64] [--prefill-len 128] [--adapters 8] [--steps 20]
        [--paths both|piecewise|eager] OVERRIDES...
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from appliance.bench.adapters import make_adapters, served_shape  # noqa: E402
from appliance.config.compose import compose_config  # noqa: E402
from appliance.engine.engine import LLMEngine  # noqa: E402
from appliance.engine.request import SamplingParams  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def run_case(eng: LLMEngine, names: list[Optional[str]], args: argparse.Namespace, rng: random.Random) -> dict:
    dev = eng.runner.device
    vocab = eng.runner.args.vocab_size
    ids = []
    for i in range(args.decode):
        rid = f"d{i}-{time.perf_counter()}"
        eng.add_request(rid, prompt(rng, args.prefill_len, vocab),
                        SamplingParams(max_tokens=4 * args.steps + 64, temperature=0.0, ignore_eos=True),
                        adapter=names[i % len(names)])
        ids.append(rid)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in eng.step()}
    for _ in range(4):
        eng.step()
    pw = eng.runner.piecewise
    piece_steps = [0]
    if pw is not None:  # counts the steps that took the piecewise path
        real_run = pw.run
        pw.run = lambda *a, **kw: (piece_steps.__setitem__(0, piece_steps[0] + 1), real_run(*a, **kw))[1]
    decode_ms, mixed_ms = [], []
    for k in range(args.steps):
        sync(dev)
        t0 = time.perf_counter()
        eng.step()
        sync(dev)
        decode_ms.append((time.perf_counter() - t0) * 1e3)
        eng.add_request(f"p{k}-{time.perf_counter()}", prompt(rng, args.prefill_len, vocab),
                        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), adapter=names[k % len(names)])
        sync(dev)
        t0 = time.perf_counter()
        eng.step()
        sync(dev)
        mixed_ms.append((time.perf_counter() - t0) * 1e3)
    prof = profile_mixed(eng, names, args, rng)
    if pw is not None:
        del pw.run
    for rid in ids:
        eng.abort(rid)
    eng.settle()
    return {"decode_ms_p50": round(statistics.median(decode_ms), 2), "mixed_ms_p50": round(statistics.median(mixed_ms), 2),
            "mixed_ms_max": round(max(mixed_ms), 2), "piecewise_steps": piece_steps[0], **prof}


def profile_mixed(eng: LLMEngine, names: list[Optional[str]], args: argparse.Namespace, rng: random.Random) -> dict:
    """One mixed step under the profiler and the sync detector; host time of the runner's stages."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dev = eng.runner.device
    vocab = eng.runner.args.vocab_size
    runner = eng.runner
    eng.step()
    eng.add_request(f"prof-{time.perf_counter()}", prompt(rng, args.prefill_len, vocab),
                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), adapter=names[0])
    eng.settle()
    sync(dev)
    stages: dict[str, float] = {}
    wrapped = {}
    for name in ("host_batch", "inputs", "attention_meta", "forward"):
        fn = getattr(runner, name)
        wrapped[name] = fn

        def timed(*a, _fn=fn, _name=name, **kw):
            t0 = time.perf_counter()
            out = _fn(*a, **kw)
            stages[_name] = stages.get(_name, 0.0) + (time.perf_counter() - t0) * 1e3
            return out

        setattr(runner, name, timed)
    if eng.lora is not None:
        fn = eng.lora.begin_step

        def timed_begin(*a, _fn=fn, **kw):
            t0 = time.perf_counter()
            out = _fn(*a, **kw)
            stages["lora.begin_step"] = stages.get("lora.begin_step", 0.0) + (time.perf_counter() - t0) * 1e3
            return out

        eng.lora.begin_step = timed_begin
    syncs: list[str] = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    if dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, profile(activities=acts) as prof:
        warnings.simplefilter("always")
        eng.step()
        sync(dev)
    wall = (time.perf_counter() - t0) * 1e3
    if dev.type == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        syncs.append(f"{Path(w.filename).name}:{w.lineno}")
    for name, fn in wrapped.items():
        setattr(runner, name, fn)
    host = python_profile(eng, names, args, rng)
    if eng.lora is not None:
        del eng.lora.begin_step
    n_kernels, kernel_us, cpu_rows = 0, 0.0, []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            n_kernels += e.count
            kernel_us += getattr(e, "self_device_time_total", 0) or 0
        else:
            cpu_rows.append((e.self_cpu_time_total / 1e3, e.count, e.key[:70]))
    cpu_rows.sort(reverse=True)
    return {"profiled_wall_ms": round(wall, 2), "stages_ms": {k: round(v, 2) for k, v in stages.items()},
            "kernels": n_kernels, "kernel_ms": round(kernel_us / 1e3, 2),
            "syncs": sorted(set(syncs))[:20],
            "top_cpu_ops": [f"{ms:.2f} ms x{n} {k}" for ms, n, k in cpu_rows[:15]], "python": host}


def python_profile(eng: LLMEngine, names: list[Optional[str]], args: argparse.Namespace, rng: random.Random,
                   steps: int = 5) -> list[str]:
    """cProfile over `steps` mixed steps: the Python functions with the most own time, per step."""
    import cProfile
    import pstats

    vocab = eng.runner.args.vocab_size
    pr = cProfile.Profile()
    for k in range(steps):
        eng.step()
        eng.add_request(f"py-{k}-{time.perf_counter()}", prompt(rng, args.prefill_len, vocab),
                        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), adapter=names[k % len(names)])
        pr.enable()
        eng.step()
        pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:25]  # (cc, nc, tottime, cumtime, callers)
    return [f"{v[2] / steps * 1e3:.2f} ms own, {v[3] / steps * 1e3:.2f} cum, x{v[1] // steps} "
            f"{Path(f).name}:{line} {fn}" for (f, line, fn), v in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--paths", choices=("both", "piecewise", "eager"), default="both",
                    help="steps with prefills: piecewise graphs, eager, or each case both ways")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mixed-ads-"))
    cfg = compose_config(overrides=args.overrides)
    cfg.lora.adapter_roots = [*cfg.lora.adapter_roots, str(root)]
    shape, std, dtype = served_shape(Path(cfg.model.path), cfg.model.dtype)
    ads = make_adapters(root, shape, args.rank, args.adapters, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"], std, dtype,
                        torch.device("cuda" if torch.cuda.is_available() else "cpu"), progress=False)
    eng = LLMEngine(cfg)
    for name, path in ads.items():
        eng.lora.load(name, str(path))
    rng = random.Random(0)
    paths = ["piecewise", "eager"] if args.paths == "both" else [args.paths]
    sizes = cfg.engine.piecewise_sizes("cuda")
    if (eng.runner.piecewise is None and "piecewise" in paths and eng.runner.device.type == "cpu" and sizes
            and eng.lora.ctx.backend != "torch"):
        eng.runner.start_piecewise(sizes, capture=False)  # a CPU smoke test of the path: the pieces uncaptured
    pw = eng.runner.piecewise
    if pw is None and "piecewise" in paths:
        print("piecewise graphs are off for this config (the log says why): eager only", file=sys.stderr)
        paths = ["eager"]
    res = {}
    for case, names in (("base", [None]), (f"{args.adapters} adapters", list(ads))):
        for path in paths:
            eng.runner.piecewise = pw if path == "piecewise" else None
            res[f"{case}, {path}"] = run_case(eng, names, args, rng)
    eng.runner.piecewise = pw
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    print("\ncase | decode step p50 ms | mixed step p50 / max ms | piecewise steps | kernels | kernel ms | "
          "profiled wall ms")
    for k, r in res.items():
        print(f"{k} | {r['decode_ms_p50']} | {r['mixed_ms_p50']} / {r['mixed_ms_max']} | {r['piecewise_steps']} | "
              f"{r['kernels']} | {r['kernel_ms']} | {r['profiled_wall_ms']}")


if __name__ == "__main__":
    main()
