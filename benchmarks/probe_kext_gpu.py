"""Probe: the prefill LoRA delta as extra K columns of the base GEMM, on a GPU.

    y = [x | h_ext] @ [W | B_ext]ᵀ,   h_ext[t] = h[t] (its adapter's block, zeros elsewhere)

cuBLAS's GEMM is compute-bound at prefill sizes, so D adapters (n slices, rank R) cost it D*n*R more
K columns (qkv at rank 16: 48 a adapter, 1.2 % of K 4096) instead of the cuBLAS order's write of a
[T, out] delta and its read as C. What it needs: x in a buffer with spare columns (the producer, e.g.
the RMSNorm, writing into it: "no copy"; or a copy here: "copy"), the shrink's h written into the
step's adapter block of those columns, and the step's B copied block-diagonally (slice i's rows, block
(j, i)) into spare columns of W. This probe times those parts in CUDA graphs, interleaved (bench_kernels_gpu.
interleaved_times), against cuBLAS alone and lora_linear (the shipped prefill path), per projection,
T tokens over 4096-token sequences on D adapters, and checks the K-extended output against lora_linear.

    python3 benchmarks/probe_kext_gpu.py [--t 4096,16384] [--d 1,4] [--proj qkv,o,down] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_kernels_gpu import DEV, LLAMA_8B, interleaved_times, offsets  # noqa: E402
from kernels.lora_linear import lora_linear  # noqa: E402
from kernels.lora_shrink import lora_shrink  # noqa: E402
from kernels.segments import sgmv_segments  # noqa: E402

RANK = 16
SEQ = 4096


def case(proj: str, T: int, D: int, smoke: bool, reps: int) -> list[str]:
    K, slices = LLAMA_8B[proj]
    if smoke:
        K, slices = K // 64, [s // 64 for s in slices]
    offs, n = offsets(slices), len(slices)
    OUT, E = offs[-1], D * n * RANK
    dt = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)
    A = (torch.randn(D, n, RANK, K, device=DEV, generator=g) * 0.02).to(dt)
    B = (torch.randn(D, OUT, RANK, device=DEV, generator=g) * 0.02).to(dt)
    ranks = torch.full((D,), RANK, dtype=torch.int32, device=DEV)
    seq = min(SEQ, T)
    lens = [seq] * (T // seq)
    seg_slots = [i % D for i in range(len(lens))]
    segs = sgmv_segments(lens, seg_slots, DEV)
    W_ext = torch.zeros(OUT, K + E, device=DEV, dtype=dt)
    W_ext[:, :K] = torch.randn(OUT, K, device=DEV, generator=g).to(dt) * 0.02
    W = W_ext[:, :K].contiguous()
    x = torch.randn(T, K, device=DEV, generator=g).to(dt)
    x_ext = torch.zeros(T, K + E, device=DEV, dtype=dt)
    x_ext[:, :K] = x
    y = torch.empty(T, OUT, device=DEV, dtype=dt)
    # Each token's block in the extra columns: its adapter's position j among the step's D.
    row_block = torch.tensor([s for m, s in zip(lens, seg_slots) for _ in range(m)], device=DEV)
    rows = torch.arange(T, device=DEV)
    slots = torch.arange(D, device=DEV)

    def fill_w() -> None:
        # The step's B, block-diagonal per slice: rows of slice i, columns K + j*n*R + i*R (j = adapter).
        tail = W_ext[:, K:].view(OUT, D, n, RANK)
        for i in range(n):
            tail[offs[i]:offs[i + 1], :, i, :].copy_(B[slots, offs[i]:offs[i + 1], :].permute(1, 0, 2))

    def fill_h() -> None:
        h = lora_shrink(x, A, segs, ranks, split_k=1)  # [T, n, R] fp32
        tail = x_ext[:, K:].view(T, D, n * RANK)
        tail.zero_()
        tail[rows, row_block] = h.view(T, n * RANK).to(dt)

    def kext_nocopy() -> None:
        fill_w()
        fill_h()
        torch.mm(x_ext, W_ext.t(), out=y)

    def kext_copy() -> None:
        x_ext[:, :K].copy_(x)
        kext_nocopy()

    fns = {
        "cuBLAS": lambda: torch.mm(x, W.t(), out=y),
        "cuBLAS, W strided": lambda: torch.mm(x, W_ext[:, :K].t(), out=y),
        "cuBLAS K+E": lambda: torch.mm(x_ext, W_ext.t(), out=y),
        "shrink": lambda: lora_shrink(x, A, segs, ranks, split_k=1),
        "fill h (shrink + torch scatter)": fill_h,
        "fill W": fill_w,
        "copy x": lambda: x_ext[:, :K].copy_(x),
        "kext, no copy": kext_nocopy,
        "kext, copy": kext_copy,
        "lora_linear (shipped)": lambda: lora_linear(x, W, A, B, segs, ranks, offs),
        "cuBLAS again": lambda: torch.mm(x, W.t(), out=y),
    }
    # correctness: K-extended output against lora_linear's
    kext_nocopy()
    want = lora_linear(x, W, A, B, segs, ranks, offs).float()
    err = ((y.float() - want).abs().max() / want.abs().max()).item()
    times = interleaved_times(list(fns.values()), reps=reps)
    base = (times[0] + times[-1]) / 2
    out = []
    for (name, _), t in zip(fns.items(), times):
        pct = (t - base) / base * 100 if name.startswith(("kext", "lora_linear", "cuBLAS K")) else t / base * 100
        out.append(f"| {proj} | {T} | {D} | {name} | {t * 1e6:.1f} | {pct:.1f} % |")
    out.append(f"| {proj} | {T} | {D} | max rel err vs lora_linear | {err:.2e} | |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", default="4096,16384")
    ap.add_argument("--d", default="1,4")
    ap.add_argument("--proj", default="qkv,o")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU + interpreter)")
    args = ap.parse_args()
    print("| proj | T | D | part | µs | % of cuBLAS (LoRA rows: added time) |")
    print("|---|---|---|---|---|---|")
    for proj in args.proj.split(","):
        for T in (int(t) for t in args.t.split(",")):
            if args.smoke:
                T = T // 256
            for D in (int(d) for d in args.d.split(",")):
                for line in case(proj, T, D, args.smoke, args.reps):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
