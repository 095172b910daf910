"""Probe: lora_apply's fused decode kernel, its two bodies and their tiles, on a GPU.

o_proj at 256 tokens / 256 adapters is the decode shape under issue 6's 70 % of copy bandwidth for its
adapter bytes. The fused kernel streams A (the shrink), then B (the expand) in one program. Its pointer
body's loads get no pipeline stages from the compiler (one tile in flight per program, a DRAM round
trip per tile); its TMA body (sm90+) loads x, A, B and y through the copy engine, which the compiler
pipelines num_stages deep (kernels/lora_apply.py). (An L2 prefetch of the program's B, or A and B, at
its start lost everywhere: docs/bench/h200-round6-decode-prefetch.txt, commit 9b916cc.) This times,
interleaved (one CUDA graph per variant, round robin, medians; the weights rotate over 256 slots so
they come from HBM), each variant for the four Llama-3.1-8B projections, after checking each against
the torch twin (mixed ranks, 1000 in A's and NaN in B's rank padding) and the fused kernel replayed
from a CUDA graph against eager.

    python3 benchmarks/probe_fused_tiles_gpu.py [--shapes 256x256,128x128,64x64] [--reps 9] [--b2b 8]
        [--variants "default;fused, pointer body"] [--projs o,down]
"""

from __future__ import annotations

import argparse

import torch

from bench_kernels_gpu import (LLAMA_8B, RANK, Proj, copy_bandwidth, interleaved_times, layouts,
                               make_segments)
from kernels import reference as ref
from kernels.lora_apply import lora_apply


def tma(stages=None, **kw):
    """The fused kernel's TMA body with tile overrides (kernels/lora_apply.py)."""
    return lambda y, x, A, B, segs, ranks, offs: lora_apply(y, x, A, B, segs, ranks, offs, fused=True, tma=True,
                                                          num_stages=stages, **kw)


def round7(y, x, A, B, segs, ranks, offs):
    """The TMA body's column splits as rounds 6-7 chose them: whole slices in 128-column steps where A's
    rows are at least twice the slice's width (down_proj), else split until the programs cover the SMs
    twice (o_proj at 256 tokens: two splits)."""
    from kernels.lora_apply import _auto_cols_per_prog
    widest = max(b - a for a, b in zip(offs, offs[1:]))
    if x.shape[1] >= 2 * widest:
        return lora_apply(y, x, A, B, segs, ranks, offs, fused=True, tma=True, block_n=128, cols_per_prog=1 << 20)
    cols = _auto_cols_per_prog(segs.num_segs * A.shape[1], widest, 256, y.device)
    return lora_apply(y, x, A, B, segs, ranks, offs, fused=True, tma=True, cols_per_prog=cols)


APPLY = lambda **kw: (lambda y, x, A, B, segs, ranks, offs: lora_apply(y, x, A, B, segs, ranks, offs, **kw))  # noqa: E731
VARIANTS = {
    "default": APPLY(),
    "fused": APPLY(fused=True),
    "fused, pointer body": APPLY(fused=True, tma=False),
    "unfused": APPLY(fused=False),
    "tma st4": tma(stages=4),
    "tma st4 bn128": tma(stages=4, block_n=128),
    "tma st6 bn128": tma(stages=6, block_n=128),
    "tma st4 bk128 bn128": tma(stages=4, block_k=128, block_n=128),
    "tma st4 bn128, 1 split": tma(stages=4, block_n=128, cols_per_prog=1 << 16),
    "tma st4 bn128 2 warps": tma(stages=4, block_n=128, num_warps=2),
    "tma st4, 4 splits": tma(stages=4, cols_per_prog=1024),
    "tma st4, 8 splits": tma(stages=4, cols_per_prog=512),
    "tma st4 2 warps": tma(stages=4, num_warps=2),
    "tma st3": tma(stages=3),
    "tma st2": tma(stages=2),
    "round 7 splits": round7,
    # Since round 8 the TMA body takes whole slices by default, so "whole bn128", "whole st3" and "whole
    # bn128 st6" equal "tma st4 bn128", "tma st3" and "tma st6 bn128" above (both names kept: each
    # round's logged commands use them)
    "whole bn128": tma(block_n=128),
    "whole st3": tma(stages=3),
    "whole st6": tma(stages=6),
    "whole bn128 st6": tma(stages=6, block_n=128),
    "y ptr": APPLY(fused=True, y_io=1),
    "y tma/ptr": APPLY(fused=True, y_io=2),
    "y tma": APPLY(fused=True, y_io=0),
}


def check(names: list[str]) -> None:
    """Every variant against the default's bits and the torch twin, bf16, qkv shape, 64 tokens on 16
    adapters with mixed ranks, rank padding poisoned."""
    K, slices = LLAMA_8B["qkv"]
    p = Proj(K, slices, 64)
    p.ranks[::3] = 8
    p.A[::3, :, 8:] = 1000.0
    p.B[::3, :, 8:] = float("nan")
    segs = make_segments("triton", [1] * 64, [i % 16 for i in range(64)])
    ts = torch.tensor([i % 16 for i in range(64)], device=p.x.device)
    want = ref.lora_expand(p.y.float().clone(), ref.lora_shrink(p.x.float(), p.A.float(), ts, p.ranks),
                           p.B.float(), ts, p.offs, p.ranks)
    outs = {}
    for name in ["fused"] + [v for v in names if v != "fused"]:
        kw = VARIANTS[name]  # the variant's callable
        y = p.y.clone()
        kw(y, p.x, p.A, p.B, segs, p.ranks, p.offs)
        outs[name] = y
        err = ((y.float() - want).norm() / want.norm()).item()
        same = torch.equal(y, outs["fused"]) if "fused" in outs else None
        print(f"check {name:18s}: rel err {err:.2e} against fp32 torch; bits equal to 'fused': {same}", flush=True)
    # the fused kernel (the TMA body on sm90+) captured in a CUDA graph, replayed on a fresh y
    y = p.y.clone()
    VARIANTS["fused"](y, p.x, p.A, p.B, segs, p.ranks, p.offs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        VARIANTS["fused"](y, p.x, p.A, p.B, segs, p.ranks, p.offs)
    y.copy_(p.y)
    g.replay()
    torch.cuda.synchronize()
    print(f"check fused from a CUDA graph: bits equal to eager: {torch.equal(y, outs['fused'])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x256,64x64,256x16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--b2b", type=int, default=1, help="applications back to back per graph (>= 8: the b2b figure)")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names from VARIANTS, ;-separated")
    ap.add_argument("--projs", default=",".join(LLAMA_8B), help="projections, ,-separated")
    args = ap.parse_args()
    names = args.variants.split(";")
    check(names)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        T, D = (int(v) for v in shape.split("x"))
        for proj in args.projs.split(","):
            K, slices = LLAMA_8B[proj]
            p = Proj(K, slices, T)
            segs = [make_segments("triton", *it) for it in layouts(T, D, T)]
            nbytes = D * (p.n * RANK * K + p.offs[-1] * RANK) * 2
            reps = max(1, -(-args.b2b // len(segs)))  # whole rotations of the slots, >= --b2b applications
            fns = [lambda f=VARIANTS[v]: [f(p.y, p.x, p.A, p.B, sg, p.ranks, p.offs) for sg in segs * reps]
                   for v in names]
            ts = [t / (len(segs) * reps) for t in interleaved_times(fns, reps=args.reps)]
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
