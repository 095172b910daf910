"""Probe: lora_linear's two prefill kernels apart, per row-tile height, on a GPU.

For each Llama-3.1-8B projection and T in (4096, 16384) tokens of one rank-16 adapter: the base GEMM,
lora_linear as shipped (LoRA µs = its time minus the base's), then lora_shrink (x read once: GB/s
over x's bytes) at BLOCK_M 16/32/64/128 with the launcher's K split and with none, and lora_expand in
write mode (GB/s over y's bytes) at BLOCK_M 16/32/64/128. Shrink and expand modes are lora_linear's
(K splits in planes up to PLANES_MAX_OUT output columns, atomics above). Prints one line per case.

    python3 benchmarks/probe_prefill_tiles_gpu.py
"""

from __future__ import annotations

import torch

from bench_kernels_gpu import LLAMA_8B, copy_bandwidth, graph_time
from kernels.lora_expand import lora_expand
from kernels.lora_linear import PLANES_MAX_OUT, lora_linear
from kernels.lora_shrink import lora_shrink
from kernels.segments import sgmv_segments

R = 16


def main() -> None:
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; copy {bw / 1e9:.0f} GB/s", flush=True)
    for name, (K, slices) in LLAMA_8B.items():
        N, n = sum(slices), len(slices)
        W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        A = torch.randn(2, n, R, K, device=dev, dtype=torch.bfloat16) * 0.02
        B = torch.randn(2, N, R, device=dev, dtype=torch.bfloat16) * 0.02
        ranks = torch.full((2,), R, dtype=torch.int32, device=dev)
        offs = [0]
        for s in slices:
            offs.append(offs[-1] + s)
        partials = N <= PLANES_MAX_OUT
        for T in (4096, 16384):
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
            segs = sgmv_segments([T], [0], dev)
            base = graph_time([lambda: torch.mm(x, W.t(), out=y)] * 3)
            lin = graph_time([lambda: lora_linear(x, W, A, B, segs, ranks, offs)] * 3)
            print(f"{name:8s} T={T:6d} base {base * 1e6:7.1f} us  lora_linear LoRA {(lin - base) * 1e6:6.1f} us "
                  f"({100 * (lin - base) / base:4.1f} %)", flush=True)
            for bm in (16, 32, 64, 128):
                for sk in (None, 1):
                    try:
                        t = graph_time([lambda: lora_shrink(x, A, segs, ranks, split_k=sk, partials=partials,
                                                            block_m=bm, num_warps=8 if bm >= 128 else 4)] * 3)
                    except Exception as e:  # a tile that does not fit: say so, go on
                        print(f"    shrink bm={bm} split={sk}: {type(e).__name__}: {str(e)[:100]}")
                        continue
                    print(f"    shrink  bm={bm:3d} split={'auto' if sk is None else sk:>4}  {t * 1e6:6.1f} us "
                          f"{100 * x.numel() * 2 / t / bw:5.1f} % copy", flush=True)
            h = lora_shrink(x, A, segs, ranks, partials=partials)
            for bm in (16, 32, 64, 128):
                try:
                    t = graph_time([lambda: lora_expand(y, h, B, segs, ranks, offs, write=True, block_m=bm)] * 3)
                except Exception as e:
                    print(f"    expand bm={bm}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                print(f"    expand  bm={bm:3d} (write)     {t * 1e6:6.1f} us {100 * y.numel() * 2 / t / bw:5.1f} % copy",
                      flush=True)


if __name__ == "__main__":
    main()
