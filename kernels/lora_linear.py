"""lora_linear: a whole LoRA-wrapped projection for prefill-shaped steps, the delta under the base GEMM.

    y[t] = x[t] @ Wᵀ + scale[slot(t)] * (x[t] @ A[slot(t), i, :r]ᵀ) @ B[slot(t), o_i:o_{i+1}, :r]ᵀ  (slices i)

The add-after order (y = x @ Wᵀ, then lora_expand reads y, adds, writes it back) moves y through
HBM twice more than the base GEMM does; for qkv_proj and o_proj at 16k tokens that alone is
~12-13 % of the GEMM's time on an H200 (docs/benchmarks.md). Here the order is turned round: the
delta is written into y first (base tokens' rows zeroed), never read back by us, then cuBLAS
accumulates the base product into y (beta = 1). A compute-bound GEMM reads C in its epilogue almost
for free, so the delta's cost falls to one write of y plus one read of x. The delta comes from
kernels/lora_delta.py (shrink and expand in one pass) on steps with enough row tiles to fill the
GPU, else from lora_shrink + lora_expand's write mode (more programs: K splits and column ranges).

Rounding differs from the add-after order by one step: the delta is rounded to y's dtype when
written, then cuBLAS adds the fp32 base product to it and rounds once (instead of rounding the base
product, then base + delta).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kernels.lora_delta import lora_delta
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.segments import LoRASegments

# Tokens in a step from which the write-then-accumulate order is used on CUDA. H200,
# docs/benchmarks.md: it beat the add-after order from 256 tokens (the fewest measured) up; the
# read of C cost cuBLAS 0-3 %. Below, the step stays with lora_apply after the GEMM.
MIN_TOKENS_CUDA = 256
# Adapter rows from which the one-pass lora_delta writes the delta on CUDA (below: shrink + expand,
# whose K splits and column ranges give small steps more programs). H200, docs/benchmarks.md.
DELTA_MIN_ROWS_CUDA = 2048


def lora_linear_pays(num_tokens: int, segs: LoRASegments, device: torch.device) -> bool:
    """Whether a step should run its wrapped projections through lora_linear (host ints only, no sync):
    multi-token segments (prefill-shaped) and, on CUDA, enough tokens for the GEMM to be compute bound.
    On CPU (Triton's interpreter) every prefill-shaped step does, so the CPU tests run this path."""
    if segs.max_len <= 1 or segs.base_rows is None:
        return False
    return device.type != "cuda" or num_tokens >= MIN_TOKENS_CUDA


def lora_delta_pays(segs: LoRASegments, device: torch.device) -> bool:
    """Whether lora_linear writes the delta in one pass (lora_delta) rather than shrink + expand.
    Always on CPU (the interpreter runs fewer programs, and the CPU tests cover this path)."""
    return device.type != "cuda" or segs.num_rows >= DELTA_MIN_ROWS_CUDA


def lora_linear(x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
                slot_ranks: torch.Tensor, out_offsets: Sequence[int],
                scalings: Optional[torch.Tensor] = None, *, fused: Optional[bool] = None,
                split_k: Optional[int] = None, partials: bool = False) -> torch.Tensor:
    """y = x @ weightᵀ + the multi-LoRA delta of every slice (lora_apply's math), as a new [T, out] tensor.

    x [T, in], weight [out, in] (no bias: the caller keeps the add-after order for biased linears),
    A [S, n, R, in], B [S, out, R], all one dtype (fp32/bf16/fp16); segs from kernels/segments.py's
    builders (they list the base tokens' rows); slot_ranks [S] int32; out_offsets [n + 1];
    scalings [S] fp32 or None. Benchmark overrides: fused (True = lora_delta, False = shrink +
    expand; None = lora_delta_pays), and for the unfused path the shrink's split_k and partials.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"lora_linear: x must be [T, in] and weight [out, in], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"lora_linear: weight and x must share a dtype, got {weight.dtype}, {x.dtype}")
    if B.dim() != 3 or B.shape[1] != weight.shape[0]:
        raise ValueError(f"lora_linear: B must be [S, {weight.shape[0]}, R], got {tuple(B.shape)}")
    T, OUT = x.shape[0], weight.shape[0]
    y = torch.empty(T, OUT, dtype=x.dtype, device=x.device)
    if fused is None:
        fused = lora_delta_pays(segs, x.device)
    if fused:
        lora_delta(y, x, A, B, segs, slot_ranks, out_offsets, scalings)
    else:
        # K split with fp32 atomics into a zeroed h by default, not planes of partial sums: every expand
        # program would re-add all planes of its rows (gate_up_proj, 1k tokens: 16 planes, 65 against 60 µs).
        h = lora_shrink(x, A, segs, slot_ranks, split_k=split_k, partials=partials)  # [(P,) T, n, R] fp32
        lora_expand(y, h, B, segs, slot_ranks, out_offsets, scalings, write=True)
    return y.addmm_(x, weight.t())  # beta = 1: cuBLAS reads the delta in its epilogue
