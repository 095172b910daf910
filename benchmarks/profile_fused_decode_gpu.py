"""One projection's fused decode LoRA application (256 tokens on 256 adapters, rank 16, bf16), a few times:
the target of an Nsight Compute profile of kernels/lora_apply.py's fused kernel on a GPU.

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats --section SchedulerStats -k regex:lora_fused -s 2 -c 1 \
        python3 benchmarks/profile_fused_decode_gpu.py o
"""

import sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from bench_kernels_gpu import LLAMA_8B, Proj, layouts, make_segments
from kernels.lora_apply import lora_apply
name = sys.argv[1] if len(sys.argv) > 1 else "o"
K, slices = LLAMA_8B[name]
p = Proj(K, slices, 256)
segs = [make_segments("triton", *it) for it in layouts(256, 256, 256)]
for _ in range(3):
    for sg in segs:
        lora_apply(p.y, p.x, p.A, p.B, sg, p.ranks, p.offs)
torch.cuda.synchronize()
