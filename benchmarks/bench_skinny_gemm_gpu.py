"""Decode-shaped base GEMMs (M = batch rows, weights streamed once): cuBLAS against alternatives, on a GPU.

At batch 64 the base decode step's GEMMs are weight streams: cuBLAS reads qkv_proj's and o_proj's
weights at ~70 % of copy bandwidth (docs/benchmarks.md), partly because its tiles leave SMs idle (96
tiles for qkv on 132 SMs). This measures, per Llama-3.1-8B projection shape at M rows:

- `cublas`: F.linear(x, W), what the engine runs;
- `halves`: the same GEMM as two launches over the two halves of N (cuBLAS picks tiles per shape);
- `cublas_t`: cuBLAS on the transposed problem, (W @ xᵀ)ᵀ (N rows of M columns: other tile choices);
- `triton BN/BK/w/s`: a plain Triton kernel, one program per BN output columns with all M rows, K in
  BK steps (no split: a program streams its BN weight rows once), written to be the simplest thing
  that fills every SM;
- `splitk BN/BK/S/w/s`: the same with K cut in S ranges, one program per (column block, range), so
  o_proj and down_proj (4096 columns: 128 programs of 32 columns for 132 SMs) get several programs
  per SM. Each program stores its fp32 partial in a workspace and counts itself in per-column-block
  counter; the last of the S to arrive sums the S partials in range order (deterministic) into y and
  resets the counter (so CUDA-graph replays need no memset).

Each time is one call, the median of 5 CUDA-graph replays of 24 calls back to back (bench_kernels_gpu's
graph_time), the calls rotating over 4 copies of the weights (past the 60 MB L2). GB/s counts the
weight bytes only (x and y are < 1 % of them); "% copy" sets it against bench_kernels_gpu's copy
bandwidth, measured in the same run. Every
variant is checked against cuBLAS first (max |diff| printed). Not a test; prints a table, writes JSON.

    python3 benchmarks/bench_skinny_gemm_gpu.py [--m 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# The kernel bench's clocks: CUDA-graph replays (graph_time) and the copy bandwidth, the same method
# as the multi-LoRA figures.
from bench_kernels_gpu import copy_bandwidth, graph_time

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CONFIGS = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4)]
# (BN, BK, S, warps, stages) for splitk, per shape: S chosen so the programs cover the SMs 2-7 times
SPLITK = {"qkv": [(32, 128, 2, 4, 4), (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (32, 64, 2, 4, 6)],
          "o": [(32, 128, 2, 4, 4), (32, 128, 4, 4, 4), (64, 128, 4, 4, 4), (16, 128, 2, 4, 4), (32, 64, 2, 4, 6)],
          "gate_up": [(64, 128, 1, 4, 4), (128, 128, 1, 4, 4), (128, 64, 1, 4, 6)],
          "down": [(32, 128, 4, 4, 4), (32, 128, 7, 4, 4), (64, 128, 7, 4, 4), (64, 128, 4, 4, 4), (32, 64, 4, 4, 6)]}
COPIES, CALLS = 4, 24


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    offs_m = tl.arange(0, BM)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k + offs_k)[None, :], mask=n_mask[:, None], other=0.0)
        acc += tl.dot(a, tl.trans(b))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K_PER, stride_xm, stride_wn, stride_ym,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k0 = pid_s * K_PER
    for k in range(k0, k0 + K_PER, BK):
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k + offs_k)[None, :], mask=n_mask[:, None], other=0.0)
        acc += tl.dot(a, tl.trans(b))
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if S == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        part = ws_ptr + offs_m[:, None] * N + offs_n[None, :]  # ws: [S, BM, N] fp32
        tl.store(part + pid_s * BM * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == S - 1:  # the last of the S: sum in range order, so the result is deterministic
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(S):
                total += tl.load(part + s * BM * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next call (graph replays: no memset)


_SCRATCH: dict = {}


def splitk(x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, s: int, warps: int, stages: int) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    bm = max(16, triton.next_power_of_2(M))
    assert K % (s * bk) == 0 and M <= 128, (K, s, bk)
    key = (x.device, bm, N, s, bn)
    if key not in _SCRATCH:  # allocated once (outside graph capture: the warm-up call comes first)
        _SCRATCH[key] = (torch.empty(s, bm, N, dtype=torch.float32, device=x.device),
                         torch.zeros(triton.cdiv(N, bn), dtype=torch.int32, device=x.device))
    ws, cnt = _SCRATCH[key]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _splitk_kernel[(triton.cdiv(N, bn), s)](x, w, y, ws, cnt, M, N, K // s, x.stride(0), w.stride(0), y.stride(0),
                                            BM=bm, BN=bn, BK=bk, S=s, num_warps=warps, num_stages=stages)
    return y


def cublas_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()


def skinny(x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, warps: int, stages: int) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    assert K % bk == 0 and M <= 128
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(N, bn),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                           BM=max(16, triton.next_power_of_2(M)), BN=bn, BK=bk,
                                           num_warps=warps, num_stages=stages)
    return y


def halves(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = w.shape[0] // 2
    return torch.cat([F.linear(x, w[:n]), F.linear(x, w[n:])], dim=1)


def rotating_calls(fn, x: torch.Tensor, ws: list[torch.Tensor]) -> list:
    """CALLS calls of fn on x, the i-th on weight copy i mod COPIES (so a replay streams them from HBM)."""
    return [lambda w=ws[i % len(ws)]: fn(x, w) for i in range(CALLS)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {bw:.0f} GB/s (read + write)", flush=True)
    rows = []
    for name in args.shapes:
        K, N = SHAPES[name]
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        wbytes = N * K * 2
        for m in args.m:
            x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
            want = F.linear(x, ws[0])
            variants = [("cublas", F.linear), ("cublas_t", cublas_t), ("halves", halves)]
            variants += [(f"triton {bn}/{bk}/{w}/{s}", (lambda x, w_, c=(bn, bk, w, s): skinny(x, w_, *c)))
                         for bn, bk, w, s in CONFIGS]
            variants += [(f"splitk {bn}/{bk}/{s}/{w}/{st}", (lambda x, w_, c=(bn, bk, s, w, st): splitk(x, w_, *c)))
                         for bn, bk, s, w, st in SPLITK[name]]
            for label, fn in variants:
                try:
                    diff = (fn(x, ws[0]).float() - want.float()).abs().max().item()
                    us = graph_time(rotating_calls(fn, x, ws)) * 1e6
                except Exception as e:  # a config that does not compile on this triton: say so, go on
                    print(f"{name:>8} M={m:<4} {label:<22} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                gbs = wbytes / (us * 1e-6) / 1e9
                rows.append({"proj": name, "m": m, "variant": label, "us": round(us, 2), "gb_s": round(gbs),
                             "pct_copy": round(100 * gbs / bw, 1), "max_abs_diff": diff})
                print(f"{name:>8} M={m:<4} {label:<22} {us:8.2f} us  {gbs:6.0f} GB/s  {100 * gbs / bw:5.1f} % copy"
                      f"  max|diff| {diff:.3g}", flush=True)
            del x
        del ws
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_gb_s": round(bw, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
