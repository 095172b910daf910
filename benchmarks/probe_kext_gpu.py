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
E is padded to whole 64-column K steps. Two ways of filling: torch ops (a gather and copy per slice
for W, a scatter for h), and two small Triton kernels here (W's tail block-diagonal in one launch;
h's K-split planes summed into the row's block in one launch) after the fastest of a few lora_shrink
tiles (timed first): "kext, no copy, Triton fills, best shrink" is what a producer-fed build would run.

    python3 benchmarks/probe_kext_gpu.py [--t 4096,16384] [--d 1,4] [--proj qkv,o,down] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_kernels_gpu import DEV, LLAMA_8B, interleaved_times, offsets  # noqa: E402
from kernels.lora_linear import lora_linear  # noqa: E402
from kernels.lora_shrink import lora_shrink  # noqa: E402
from kernels.segments import sgmv_segments  # noqa: E402

RANK = 16
SEQ = 4096
# lora_shrink tile variants for the K-extended path (h in planes: the fill of h_ext sums them)
SHRINKS = {"shrink": {}, "shrink bm32": dict(block_m=32), "shrink bm64 sk2": dict(block_m=64, split_k=2),
           "shrink bm32 sk2": dict(block_m=32, split_k=2), "shrink bm128 sk4": dict(block_m=128, split_k=4)}


@triton.jit
def _fill_w_kernel(w_ptr, b_ptr, slot_ptr, K, OUT, E, NR, R, D, o1, o2, stride_w, stride_bs, stride_bo,
                   BLOCK_O: tl.constexpr, BLOCK_E: tl.constexpr):
    # W_ext[o, K + c] = B[slot_j, o, r] where column c = j*NR + i*R + r and row o is in slice i; else 0
    o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)[:, None]
    c = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)[None, :]
    j = c // NR
    i = (c % NR) // R
    r = c % R
    row_slice = (o >= o1).to(tl.int32) + (o >= o2).to(tl.int32)
    slot = tl.load(slot_ptr + j, mask=(j < D) & (c < E), other=0)
    live = (j < D) & (row_slice == i) & (o < OUT) & (c < E)
    v = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + o * stride_bo + r, mask=live, other=0.0)
    tl.store(w_ptr + o.to(tl.int64) * stride_w + K + c, v, mask=(o < OUT) & (c < E))


@triton.jit
def _fill_h_kernel(x_ptr, h_ptr, blk_ptr, K, T, E, NR, P, stride_x, stride_hp,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    # x_ext[t, K + c] = sum_p h[p, t, c % NR] where c // NR is row t's block; else 0
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    c = tl.arange(0, BLOCK_E)[None, :]
    blk = tl.load(blk_ptr + t, mask=t < T, other=-1)
    live = (c // NR == blk) & (t < T) & (c < E)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for p in range(P):
        acc += tl.load(h_ptr + p * stride_hp + t * NR + c % NR, mask=live, other=0.0)
    tl.store(x_ptr + t.to(tl.int64) * stride_x + K + c, acc.to(x_ptr.dtype.element_ty), mask=(t < T) & (c < E))


def case(proj: str, T: int, D: int, smoke: bool, reps: int) -> list[str]:
    K, slices = LLAMA_8B[proj]
    if smoke:
        K, slices = K // 64, [s // 64 for s in slices]
    offs, n = offsets(slices), len(slices)
    OUT = offs[-1]
    E = -(-D * n * RANK // 64) * 64  # whole 64-column K steps: K + 48 cost cuBLAS 3.4-5 %, K + 64 0.8-1.3
    dt = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)
    A = (torch.randn(D, n, RANK, K, device=DEV, generator=g) * 0.02).to(dt)
    B = (torch.randn(D, OUT, RANK, device=DEV, generator=g) * 0.02).to(dt)
    ranks = torch.full((D,), RANK, dtype=torch.int32, device=DEV)
    seq = min(SEQ, T) if not smoke else max(1, T // 4)  # smoke: 4 sequences, D adapters among them
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
        tail = W_ext[:, K:K + D * n * RANK].view(OUT, D, n, RANK)
        for i in range(n):
            tail[offs[i]:offs[i + 1], :, i, :].copy_(B[slots, offs[i]:offs[i + 1], :].permute(1, 0, 2))

    def fill_h() -> None:
        h = lora_shrink(x, A, segs, ranks, split_k=1)  # [T, n, R] fp32
        tail = x_ext[:, K:K + D * n * RANK].view(T, D, n * RANK)
        tail.zero_()
        tail[rows, row_block] = h.view(T, n * RANK).to(dt)

    def kext_nocopy() -> None:
        fill_w()
        fill_h()
        torch.mm(x_ext, W_ext.t(), out=y)

    def kext_copy() -> None:
        x_ext[:, :K].copy_(x)
        kext_nocopy()

    slot_t = slots.to(torch.int32)
    blk_t = row_block.to(torch.int32)
    o1 = offs[1] if n > 1 else OUT
    o2 = offs[2] if n > 2 else OUT

    def fill_w_triton() -> None:
        _fill_w_kernel[(triton.cdiv(OUT, 64), triton.cdiv(E, 64))](
            W_ext, B, slot_t, K, OUT, E, n * RANK, RANK, D, o1, o2, W_ext.stride(0), B.stride(0), B.stride(1),
            BLOCK_O=64, BLOCK_E=64)

    def fill_h_triton(h: torch.Tensor) -> None:
        P = h.shape[0] if h.dim() == 4 else 1
        _fill_h_kernel[(triton.cdiv(T, 32),)](
            x_ext, h, blk_t, K, T, E, n * RANK, P, x_ext.stride(0), T * n * RANK,
            BLOCK_T=32, BLOCK_E=triton.next_power_of_2(E))

    best_kw = {}

    def kext_triton() -> None:
        fill_w_triton()
        h = lora_shrink(x, A, segs, ranks, partials=True, **best_kw)
        fill_h_triton(h)
        torch.mm(x_ext, W_ext.t(), out=y)

    fns = {
        "cuBLAS": lambda: torch.mm(x, W.t(), out=y),
        "cuBLAS, W strided": lambda: torch.mm(x, W_ext[:, :K].t(), out=y),
        "cuBLAS K+E": lambda: torch.mm(x_ext, W_ext.t(), out=y),
        **{name: (lambda kw=kw: lora_shrink(x, A, segs, ranks, partials=True, **kw)) for name, kw in SHRINKS.items()},
        "fill W (Triton)": fill_w_triton,
        "fill h (Triton, planes of 'shrink')": lambda: fill_h_triton(lora_shrink(x, A, segs, ranks, partials=True)),
        "fill h (shrink + torch scatter)": fill_h,
        "fill W": fill_w,
        "copy x": lambda: x_ext[:, :K].copy_(x),
        "kext, no copy": kext_nocopy,
        "kext, copy": kext_copy,
        "kext, no copy, Triton fills, best shrink": kext_triton,
        "lora_linear (shipped)": lambda: lora_linear(x, W, A, B, segs, ranks, offs),
        "cuBLAS again": lambda: torch.mm(x, W.t(), out=y),
    }
    # the best shrink tiles first (kext_triton uses them), then correctness against lora_linear's output
    st = interleaved_times([fns[k] for k in SHRINKS], reps=reps)
    best_kw.update(SHRINKS[list(SHRINKS)[st.index(min(st))]])
    want = lora_linear(x, W, A, B, segs, ranks, offs).float()
    kext_nocopy()
    err = ((y.float() - want).abs().max() / want.abs().max()).item()
    kext_triton()
    err2 = ((y.float() - want).abs().max() / want.abs().max()).item()
    times = interleaved_times(list(fns.values()), reps=reps)
    base = (times[0] + times[-1]) / 2
    out = []
    for (name, _), t in zip(fns.items(), times):
        pct = (t - base) / base * 100 if name.startswith(("kext", "lora_linear", "cuBLAS K")) else t / base * 100
        out.append(f"| {proj} | {T} | {D} | {name} | {t * 1e6:.1f} | {pct:.1f} % |")
    out.append(f"| {proj} | {T} | {D} | max rel err vs lora_linear (torch fills / Triton fills) | {err:.2e} / {err2:.2e} | "
               f"best shrink: {best_kw} |")
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
