"""Probe: what merging a rank-16 adapter into the base weight (W' = W + B A, dLoRA-style, for long prefill
segments) would cost on a GPU, against the base GEMM at 4096 and 16384 tokens. Not shipped; the figures and
why the idea was dropped are in docs/benchmarks.md ("Five more levers that lost, ...").

    python3 benchmarks/probe_merge_gpu.py

Per Llama-3.1-8B projection: the base GEMM, the merge (one cuBLAS addmm per output slice, K = 16),
the GEMM on the merged weight, and the LoRA share (merge + merged GEMM - base) / base; the last column
is four merges (four adapters in a 16k-token step) over the base.
"""

from __future__ import annotations

import torch

# the kernel bench's clocks: CUDA-graph replays and the copy bandwidth measured in the same run
from bench_kernels_gpu import LLAMA_8B, copy_bandwidth, graph_time



def main() -> None:
    dev = torch.device("cuda")
    bw = copy_bandwidth() / 1e9
    print(f"copy {bw:.0f} GB/s")
    for name, (K, slices) in LLAMA_8B.items():
        N, n = sum(slices), len(slices)
        W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        merged = torch.empty_like(W)
        A = torch.randn(n, 16, K, device=dev, dtype=torch.bfloat16) * 0.01
        B = torch.randn(N, 16, device=dev, dtype=torch.bfloat16) * 0.01
        offs = [0]
        for s in slices:
            offs.append(offs[-1] + s)

        def merge() -> None:
            for i in range(n):
                lo, hi = offs[i], offs[i + 1]
                torch.addmm(W[lo:hi], B[lo:hi], A[i], out=merged[lo:hi])

        t_merge = graph_time([merge] * 4)
        for T in (4096, 16384):
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
            t_base = graph_time([lambda: torch.mm(x, W.t(), out=y)] * 3)
            t_merged = graph_time([lambda: torch.mm(x, merged.t(), out=y)] * 3)
            print(f"{name:8s} T={T:6d} base {t_base * 1e6:8.1f} us  merge {t_merge * 1e6:6.1f} us "
                  f"({2 * W.numel() * 2 / t_merge / 1e9 / bw * 100:.0f} % copy)  merged GEMM {t_merged * 1e6:8.1f}  "
                  f"LoRA% {100 * (t_merge + t_merged - t_base) / t_base:5.1f}  x4 merges at 16k: "
                  f"{100 * 4 * t_merge / t_base:5.1f}", flush=True)


if __name__ == "__main__":
    main()
