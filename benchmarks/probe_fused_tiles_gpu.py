"""Probe: lora_apply's fused decode kernel over its tile parameters at 256 tokens / 256 adapters, on a GPU.

o_proj is the decode shape under issue 6's 70 % (49-55 % of copy bandwidth for its adapter bytes with the
launcher's tiles). This times the fused kernel for o_proj and down_proj (one slice each) over block_k,
num_warps, num_stages, block_n and cols_per_prog, the way bench_kernels_gpu's decode rows do (CUDA-graph
replays over rotating slots, so the adapter bytes come from HBM). Prints µs and % of copy bandwidth.

    python3 benchmarks/probe_fused_tiles_gpu.py
"""

from __future__ import annotations

import itertools

import torch

from bench_kernels_gpu import LLAMA_8B, RANK, Proj, copy_bandwidth, graph_time, layouts, make_segments
from kernels.lora_apply import lora_apply


def main() -> None:
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {bw / 1e9:.0f} GB/s", flush=True)
    T = D = 256
    configs = [dict()] + [dict(block_k=bk, num_warps=w, num_stages=st)
                          for bk, w, st in itertools.product((256, 512, 1024), (4, 8), (2, 3, 4))]
    configs += [dict(block_n=128), dict(block_n=512), dict(cols_per_prog=4096, num_warps=8),
                dict(cols_per_prog=1024, block_k=1024, num_warps=8)]
    for name in ("o", "down"):
        K, slices = LLAMA_8B[name]
        p = Proj(K, slices, T)
        segs = [make_segments("triton", *it) for it in layouts(T, D, T)]
        nbytes = D * (p.n * RANK * K + p.offs[-1] * RANK) * 2
        for kw in configs:
            try:
                t = graph_time([lambda sg=sg: lora_apply(p.y, p.x, p.A, p.B, sg, p.ranks, p.offs, fused=True, **kw)
                                for sg in segs])
            except Exception as e:  # a tile that does not fit: say so, go on
                print(f"{name:5s} {kw}: {type(e).__name__}: {str(e)[:90]}", flush=True)
                continue
            print(f"{name:5s} {str(kw) if kw else 'launcher default':60s} {t * 1e6:6.1f} us "
                  f"{100 * nbytes / t / bw:5.1f} % copy", flush=True)
        p = None


if __name__ == "__main__":
    main()
