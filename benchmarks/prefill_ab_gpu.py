"""Engine prefill A/B of `lora.prefill_gemm` choices in one process, on a GPU.

`appliance bench offline` measures prefill once per engine, and runs of the same code differ by up to
~0.7 % between processes (0.939-0.946 of base in round 6): too coarse for a change worth 1-2 %. Here
one engine (the bench's synthetic adapters, its warm-up) serves every mode: `lora.prefill_gemm` is
read per call by the LoRA wrappers, so flipping `engine.lora.ctx.prefill_gemm` between runs switches
the path (auto: gate_up_proj's delta inside the activation where the MLP's fused kernels run, and
lora_gemm for 4096-8192-token steps; triton: lora_gemm for every projection; cublas: the cuBLAS
order). Each rep runs the base prefill and every mode once, round robin; medians and every run printed.
A mode "auto:M:N:S" also sets kernels/silu_mul_lora.py's tile body (TILE_M rows, TILE_N columns,
TILE_STAGES) for its runs.

    python3 benchmarks/prefill_ab_gpu.py [--modes auto,triton,cublas,auto:16:64:3] [--reps 5] [--requests 128]
        [--len 512] [--adapters 16] model=llama3-8b-shape engine=gpu lora=gpu lora.backend=triton
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.bench.offline import prefill  # noqa: E402
from appliance.bench.options import BenchOptions  # noqa: E402
from appliance.bench.suite import Bench  # noqa: E402
from appliance.bench.workload import random_prompts  # noqa: E402
from appliance.config.compose import compose_config  # noqa: E402
import kernels.silu_mul_lora as sml  # noqa: E402

MODES = {"auto": None, "triton": "triton", "cublas": "cublas"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="auto,triton")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--config-dir", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    modes = args.modes.split(",")
    cfg = compose_config(args.config_dir, ["adapters=[]", *args.overrides])  # only the synthetic adapters
    opts = BenchOptions(mode="offline", ranks=[args.rank], prefill_requests=args.requests, prefill_len=args.len,
                        prefill_adapters=args.adapters, progress=False)
    bench = Bench(cfg, opts, " ".join(sys.argv))
    bench.adapter_root = Path(tempfile.mkdtemp(prefix="prefill-ab-"))
    dirs = bench.synthetic_adapters(args.rank, args.adapters)
    eng = bench.build_engine("prefill-ab", args.adapters, args.adapters, args.requests)
    bench.load_adapters(eng, dirs)
    names = list(dirs)
    prompts = random_prompts(args.requests, args.len, bench.args.vocab_size, 3)
    keys = [names[i % len(names)] for i in range(len(prompts))]
    runs: dict[str, list[float]] = {"base": [], **{m: [] for m in modes}}

    tile = (sml.TILE_M, sml.TILE_N, sml.TILE_STAGES)

    def one(label: str, rec: bool) -> None:
        if label != "base":
            mode, *t = label.split(":")
            eng.lora.ctx.prefill_gemm = MODES[mode]
            sml.TILE_M, sml.TILE_N, sml.TILE_STAGES = [int(v) for v in t] if t else tile
        r = prefill(eng, prompts, [None] * len(prompts) if label == "base" else keys, label)
        if rec:
            runs[label].append(r["prefill_tok_s"])

    for label in runs:  # warm-up: each path's first steps (allocations, any compile) untimed
        one(label, False)
    for rep in range(args.reps):
        for label in runs:
            one(label, True)
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items()), flush=True)
    base = statistics.median(runs["base"])
    print(f"\n{args.requests} x {args.len} tokens, {args.adapters} distinct rank-{args.rank} adapters, "
          f"{args.reps} reps round robin (one engine)\n")
    print("| path | prefill tok/s (median) | / base | runs |")
    print("|---|---|---|---|")
    for k, v in runs.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.0f} | {m / base:.3f} | {', '.join(f'{x:.0f}' for x in v)} |")
    eng.close()


if __name__ == "__main__":
    main()
