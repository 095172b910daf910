"""Probe: the LoRA shrink inside the fused add + RMSNorm that feeds qkv_proj (prefill), on a GPU.

The shrink's own read of x costs 190/N of the GEMM's time at prefill sizes (qkv: 3.1 %; docs/benchmarks.md
round 11), and at 4096 tokens a standalone shrink reaches only ~60 % of copy bandwidth (5.8-7.3 % of the
qkv GEMM). The norm already reads each row and writes the projection's input: if it also took the rank
product, h would cost no read of x at all; with h in spare K columns of that input (probe_kext_gpu.py) the
delta would cost cuBLAS ~1.3 % more K, and the whole qkv LoRA a few % of the GEMM. This probe times how much
the shrink adds to the norm kernel: a program takes BLOCK_M rows (one adapter among them: prefill rows come
in long segments), pass 1 adds the residual, stores the sum and takes the sum of squares in BLOCK_K column
steps; pass 2 re-reads the sum (L2), normalises, stores the projection input and accumulates h = out @ A^T
on tensor cores, A's [n*R, BLOCK_K] tiles from L2. Interleaved CUDA graphs (bench_kernels_gpu.
interleaved_times) against kernels/rms_norm.py alone, lora_shrink alone and the two one after the other,
Llama-3.1-8B's hidden size 4096, qkv's n*R = 48 at rank 16; "% of qkv GEMM" against cuBLAS's x @ Wqkv^T
timed in the same set. Checks the fused outputs against rms_norm's and lora_shrink's.

    python3 benchmarks/probe_norm_shrink_gpu.py [--t 4096,16384] [--smoke]
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

from bench_kernels_gpu import DEV, interleaved_times  # noqa: E402
from kernels.lora_shrink import lora_shrink  # noqa: E402
from kernels.platform import dot_upcast  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402
from kernels.segments import sgmv_segments  # noqa: E402

RANK, SLICES, SEQ = 16, 3, 4096
VARIANTS = {"bm16 bk128": (16, 128, 4), "bm32 bk128": (32, 128, 4), "bm64 bk128": (64, 128, 4),
            "bm32 bk256": (32, 256, 8), "bm16 bk256": (16, 256, 4)}


@triton.jit
def _norm_shrink_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,  # [T, H] each ([H] for w), rms_norm's operands
    a_ptr, h_ptr, blk_slot_ptr,  # A [S, N, H]; h [T, N] fp32; slot of each row block (-1: none)
    T, H, N, eps, stride_x, stride_r, stride_o, stride_ro, stride_as, stride_an, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = rows < T
    dt = x_ptr.dtype.element_ty
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mk = m_mask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mk, other=0.0)
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mk, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # the model's add, rounded (rms_norm's order)
        tl.store(res_out_ptr + rows[:, None] * stride_ro + cols[None, :], s, mask=mk)
        sf = s.to(tl.float32)
        ss += tl.sum(sf * sf, axis=1)
    rstd = tl.rsqrt(ss / H + eps)
    tl.debug_barrier()  # pass 2 reads the sums other threads of this program stored
    slot = tl.load(blk_slot_ptr + pid)
    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mk = m_mask[:, None] & (cols < H)[None, :]
        s = tl.load(res_out_ptr + rows[:, None] * stride_ro + cols[None, :], mask=mk, other=0.0).to(tl.float32)
        n = (s * rstd[:, None]).to(dt)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        o = (w[None, :] * n.to(tl.float32)).to(dt)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], o, mask=mk)
        if slot >= 0:
            a = tl.load(a_ptr + slot.to(tl.int64) * stride_as + offs_n[:, None] * stride_an + cols[None, :],
                        mask=(offs_n < N)[:, None] & (cols < H)[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(o.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(o, tl.trans(a))
    if slot >= 0:
        tl.store(h_ptr + rows[:, None] * stride_h + offs_n[None, :], acc,
                 mask=m_mask[:, None] & (offs_n < N)[None, :])


def norm_shrink(x, res, w, eps, A, blk_slots, out, res_out, h, block_m, block_k, warps):
    T, H = x.shape
    N = A.shape[1] * A.shape[2]
    a3 = A.view(A.shape[0], N, H)
    _norm_shrink_kernel[(triton.cdiv(T, block_m),)](
        x, res, w, out, res_out, a3, h, blk_slots, T, H, N, eps,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), a3.stride(0), a3.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=max(16, triton.next_power_of_2(N)),
        UPCAST=dot_upcast(x.dtype), num_warps=warps)


def case(T: int, smoke: bool, reps: int) -> list[str]:
    H = 4096 if not smoke else 64
    qkv_out = 6144 if not smoke else 96
    dt = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, H, device=DEV, generator=g).to(dt)
    res = torch.randn(T, H, device=DEV, generator=g).to(dt)
    w = (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).to(dt)
    A = (torch.randn(4, SLICES, RANK, H, device=DEV, generator=g) * 0.02).to(dt)
    W = (torch.randn(qkv_out, H, device=DEV, generator=g) * 0.02).to(dt)
    ranks = torch.full((4,), RANK, dtype=torch.int32, device=DEV)
    seq = min(SEQ, T)  # smoke: T = 64, one sequence (row blocks of up to 64 rows lie in one)
    lens = [seq] * (T // seq)
    seg_slots = [i % 4 for i in range(len(lens))]
    segs = sgmv_segments(lens, seg_slots, DEV)
    row_slot = torch.tensor([s for m, s in zip(lens, seg_slots) for _ in range(m)], device=DEV, dtype=torch.int32)
    out = torch.empty(T, H, device=DEV, dtype=dt)
    res_out = torch.empty(T, H, device=DEV, dtype=dt)
    h = torch.empty(T, SLICES * RANK, device=DEV, dtype=torch.float32)
    y = torch.empty(T, qkv_out, device=DEV, dtype=dt)
    eps = 1e-5

    def blk(bm: int) -> torch.Tensor:  # each row block lies in one sequence (seq is a multiple of bm)
        return row_slot[::bm].contiguous()

    # correctness: the fused kernel against rms_norm and lora_shrink
    want_out, want_s = rms_norm(x, w, eps, res)
    want_h = lora_shrink(want_out, A, segs, ranks).view(T, -1)
    lines = []
    for name, (bm, bk, wp) in VARIANTS.items():
        norm_shrink(x, res, w, eps, A, blk(bm), out, res_out, h, bm, bk, wp)
        e_out = (out.float() - want_out.float()).abs().max().item()
        e_s = (res_out.float() - want_s.float()).abs().max().item()
        e_h = ((h - want_h).abs().max() / want_h.abs().max()).item()
        lines.append(f"| {T} | check {name} | out max abs diff {e_out:.2e}, sum {e_s:.2e}, h rel {e_h:.2e} | |")
    fns = {"cuBLAS qkv GEMM": lambda: torch.mm(out, W.t(), out=y),
           "rms_norm (shipped)": lambda: rms_norm(x, w, eps, res, out=out, residual_out=res_out),
           "lora_shrink alone": lambda: lora_shrink(out, A, segs, ranks),
           "lora_shrink alone, bm128 sk4": lambda: lora_shrink(out, A, segs, ranks, partials=True, block_m=128,
                                                              split_k=4),
           "rms_norm then lora_shrink": lambda: (rms_norm(x, w, eps, res, out=out, residual_out=res_out),
                                                 lora_shrink(out, A, segs, ranks))}
    for name, (bm, bk, wp) in VARIANTS.items():
        b = blk(bm)
        fns[f"norm + shrink {name}"] = (lambda b=b, bm=bm, bk=bk, wp=wp:
                                        norm_shrink(x, res, w, eps, A, b, out, res_out, h, bm, bk, wp))
    times = interleaved_times(list(fns.values()), reps=reps)
    gemm, norm = times[0], times[1]
    for (name, _), t in zip(fns.items(), times):
        extra = t - norm if name.startswith(("norm +", "rms_norm then")) else t
        note = "" if name.startswith(("cuBLAS", "rms_norm (")) else f"{100 * extra / gemm:.1f} %"
        lines.append(f"| {T} | {name} | {t * 1e6:.1f} | {note} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", default="4096,16384")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU + interpreter)")
    args = ap.parse_args()
    print("| T | kernel | µs | LoRA cost, % of the qkv GEMM (fused: minus rms_norm alone) |")
    print("|---|---|---|---|")
    for T in (int(t) for t in args.t.split(",")):
        for line in case(T if not args.smoke else 64, args.smoke, args.reps):
            print(line, flush=True)


if __name__ == "__main__":
    main()
