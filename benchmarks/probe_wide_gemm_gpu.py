"""Probe: the prefill LoRA delta inside the base GEMM through spare K columns, on a GPU.

    y = [x | h] @ [W | Bcat]ᵀ      x [T, K], h [T, D*R] (token t's h in its adapter's R columns, 0 elsewhere),
                                   W [N, K], Bcat [N, D*R] (the step's D adapters' B side by side)

If x and W are stored with spare columns (row strides K + P), one cuBLAS GEMM over K + D*R columns
adds the delta with no y write: the LoRA cost is the shrink (x read) plus D*R/K more GEMM work.
This times, per Llama-3.1-8B projection and T in (4096, 16384): the base GEMM on plain tensors, the
base GEMM on the strided views of the wide tensors (what every other step would run), the wide GEMM
over K + 16, K + 64 and K + 128 columns (1, 4, 8 adapters at rank 16), and lora_shrink for one adapter
(segments of 4096 tokens), against the engine's lora_linear for the same step.

    python3 benchmarks/probe_wide_gemm_gpu.py
"""

from __future__ import annotations

import torch

from bench_kernels_gpu import LLAMA_8B, copy_bandwidth, graph_time
from kernels.lora_linear import lora_linear
from kernels.lora_shrink import lora_shrink
from kernels.segments import sgmv_segments

R, SLOTS, P = 16, 4, 128


def main() -> None:
    dev = torch.device("cuda")
    bw = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; copy {bw:.0f} GB/s")
    print("proj     T   base  strided  K+16  K+64  K+128  shrink  lora_linear (µs) | LoRA % of base: "
          "K+16 + shrink, K+64 + shrink, K+128 + shrink, lora_linear")
    for name, (K, slices) in LLAMA_8B.items():
        N, n = sum(slices), len(slices)
        w_wide = torch.randn(N, K + P, device=dev, dtype=torch.bfloat16) * 0.02
        w = w_wide[:, :K].contiguous()
        A = torch.randn(SLOTS, n, R, K, device=dev, dtype=torch.bfloat16) * 0.02
        B = torch.randn(SLOTS, N, R, device=dev, dtype=torch.bfloat16) * 0.02
        ranks = torch.full((SLOTS,), R, dtype=torch.int32, device=dev)
        offs = [0]
        for s in slices:
            offs.append(offs[-1] + s)
        for T in (4096, 16384):
            x_wide = torch.randn(T, K + P, device=dev, dtype=torch.bfloat16)
            x = x_wide[:, :K].contiguous()
            y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
            segs = sgmv_segments([4096] * (T // 4096), [0] * (T // 4096), dev)
            t = {
                "base": graph_time([lambda: torch.mm(x, w.t(), out=y)] * 3),
                "strided": graph_time([lambda: torch.mm(x_wide[:, :K], w_wide[:, :K].t(), out=y)] * 3),
                "w16": graph_time([lambda: torch.mm(x_wide[:, :K + 16], w_wide[:, :K + 16].t(), out=y)] * 3),
                "w64": graph_time([lambda: torch.mm(x_wide[:, :K + 64], w_wide[:, :K + 64].t(), out=y)] * 3),
                "w128": graph_time([lambda: torch.mm(x_wide[:, :K + 128], w_wide[:, :K + 128].t(), out=y)] * 3),
                "shrink": graph_time([lambda: lora_shrink(x, A, segs, ranks)] * 3),
                "linear": graph_time([lambda: lora_linear(x, w, A, B, segs, ranks, offs)] * 3),
            }
            b = t["base"]
            print(f"{name:8s} {T:6d} " + " ".join(f"{v * 1e6:8.1f}" for v in t.values())
                  + " | " + " ".join(f"{100 * (t[k] + t['shrink'] - b) / b:6.1f}" for k in ("w16", "w64", "w128"))
                  + f" {100 * (t['linear'] - b) / b:6.1f}", flush=True)


if __name__ == "__main__":
    main()
