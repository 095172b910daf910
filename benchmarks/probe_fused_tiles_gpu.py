"""Probe: lora_apply's fused decode kernel over its options (L2 prefetch, tiles), on a GPU.

o_proj at 256 tokens / 256 adapters is the decode shape under issue 6's 70 % (49-55 % of copy bandwidth
for its adapter bytes). The fused kernel streams A (the shrink), then B (the expand) in one program,
one tile in flight at a time (these loads are not pipelined through shared memory), so each program
spends two DRAM latencies per tile. `prefetch` asks L2 for the program's B (1) or A and B (2) at its
start. This times, interleaved (one CUDA graph per variant, round robin, medians; the weights rotate
over 256 slots so they come from HBM), each variant for the four Llama-3.1-8B projections, and first
checks that every variant writes the same bits as the launcher's default and matches the torch twin.

    python3 benchmarks/probe_fused_tiles_gpu.py [--shapes 256x256,64x64,256x16] [--reps 9]
"""

from __future__ import annotations

import argparse

import torch

from bench_kernels_gpu import (LLAMA_8B, RANK, Proj, copy_bandwidth, interleaved_times, layouts,
                               make_segments)
from kernels import reference as ref
from kernels.lora_apply import lora_apply

VARIANTS = {
    "default": dict(),
    "fused": dict(fused=True),
    "pf B": dict(fused=True, prefetch=1),
    "pf A+B": dict(fused=True, prefetch=2),
    "pf B, 1 split": dict(fused=True, prefetch=1, cols_per_prog=1 << 16),
    "pf A+B, 1 split": dict(fused=True, prefetch=2, cols_per_prog=1 << 16),
    "pf A+B, 8 warps": dict(fused=True, prefetch=2, num_warps=8),
    "pf B, bk 256": dict(fused=True, prefetch=1, block_k=256),
}


def check() -> None:
    """Every variant against the default's bits and the torch twin, bf16, qkv shape, 64 tokens on 16
    adapters with mixed ranks (prefetch is a hint: the bits must not move)."""
    K, slices = LLAMA_8B["qkv"]
    p = Proj(K, slices, 64)
    p.ranks[::3] = 8
    segs = make_segments("triton", [1] * 64, [i % 16 for i in range(64)])
    ts = torch.tensor([i % 16 for i in range(64)], device=p.x.device)
    want = ref.lora_expand(p.y.float().clone(), ref.lora_shrink(p.x.float(), p.A.float(), ts, p.ranks),
                           p.B.float(), ts, p.offs, p.ranks)
    outs = {}
    for name, kw in VARIANTS.items():
        y = p.y.clone()
        lora_apply(y, p.x, p.A, p.B, segs, p.ranks, p.offs, **kw)
        outs[name] = y
        err = ((y.float() - want).norm() / want.norm()).item()
        same = torch.equal(y, outs["fused"]) if "fused" in outs else None
        print(f"check {name:18s}: rel err {err:.2e} against fp32 torch; bits equal to 'fused': {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x256,64x64,256x16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names from VARIANTS, ;-separated")
    args = ap.parse_args()
    check()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {bw / 1e9:.0f} GB/s", flush=True)
    names = args.variants.split(";")
    rows = []
    for shape in args.shapes.split(","):
        T, D = (int(v) for v in shape.split("x"))
        for proj, (K, slices) in LLAMA_8B.items():
            p = Proj(K, slices, T)
            segs = [make_segments("triton", *it) for it in layouts(T, D, T)]
            nbytes = D * (p.n * RANK * K + p.offs[-1] * RANK) * 2
            fns = [lambda kw=VARIANTS[v]: [lora_apply(p.y, p.x, p.A, p.B, sg, p.ranks, p.offs, **kw) for sg in segs]
                   for v in names]
            ts = [t / len(segs) for t in interleaved_times(fns, reps=args.reps)]
            row = f"| {proj} | {T} | {D} | " + " | ".join(f"{t * 1e6:.1f} ({100 * nbytes / t / bw:.0f} %)" for t in ts) + " |"
            rows.append(row)
            print(row, flush=True)
            p = None
    print("\nµs (% of copy bandwidth for the adapter bytes), interleaved medians:\n")
    print("| proj | T | D | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
