"""lora_linear: a whole LoRA-wrapped projection for prefill-shaped steps, the delta under the base GEMM.

    y[t] = x[t] @ Wᵀ + scale[slot(t)] * (x[t] @ A[slot(t), i, :r]ᵀ) @ B[slot(t), o_i:o_{i+1}, :r]ᵀ  (slices i)

The add-after order (y = x @ Wᵀ, then lora_expand reads y, adds, writes it back) moves y through
HBM twice more than the base GEMM does, which alone exceeds the LoRA target of 10 % of the GEMM's
time for qkv_proj and o_proj. Here the order is turned round:
lora_shrink (h, fp32), then lora_expand in write mode (y = the delta, written once and never read;
base tokens' rows zeroed), then cuBLAS accumulates the base product into y (beta = 1). A
compute-bound GEMM reads C in its epilogue almost for free, so the delta's cost falls to one write
of y plus the shrink's read of x. (Shrink and expand in one kernel, x read and y written by one
pass, measured no faster.)

Rounding differs from the add-after order by one step: the delta is rounded to y's dtype when
written, then cuBLAS adds the fp32 base product to it and rounds once (instead of rounding the base
product, then base + delta).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kernels.lora_expand import lora_expand
from kernels.lora_gemm import lora_gemm
from kernels.lora_shrink import lora_shrink
from kernels.platform import pdl_available
from kernels.segments import LoRASegments

# Widest output whose shrink K splits go to planes (each expand column program re-reads them all); wider: atomics.
PLANES_MAX_OUT = 8192


def lora_linear(x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
                slot_ranks: torch.Tensor, out_offsets: Sequence[int],
                scalings: Optional[torch.Tensor] = None, *, split_k: Optional[int] = None,
                partials: Optional[bool] = None, pdl: Optional[bool] = None,
                gemm: str = "cublas") -> torch.Tensor:
    """y = x @ weightᵀ + the multi-LoRA delta of every slice (lora_apply's math), as a new [T, out] tensor.

    x [T, in], weight [out, in] (no bias: the caller keeps the add-after order for biased linears),
    A [S, n, R, in], B [S, out, R], all one dtype (fp32/bf16/fp16); segs from kernels/segments.py's
    builders (they list the base tokens' rows); slot_ranks [S] int32; out_offsets [n + 1];
    scalings [S] fp32 or None. split_k, partials: the shrink's K split (None = its launcher's choice)
    and how the splits combine (True: planes of partial sums, False: atomics; None = planes up to
    PLANES_MAX_OUT output columns); overrides for benchmarks. pdl: the expand launched as a
    programmatic dependent of the shrink (its launch under the shrink's tail; None = where the device
    has PDL). gemm: "cublas" (the delta written, then cuBLAS accumulates) or "triton" (kernels/lora_gemm.py:
    one launch, the shrink as tiles of its grid and the delta in the epilogue of its GEMM; needs
    segs.row_slots; split_k, partials and pdl do not apply). Which one pays for a step is the caller's
    choice (appliance/lora/backend/policy.py).
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"lora_linear: x must be [T, in] and weight [out, in], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"lora_linear: weight and x must share a dtype, got {weight.dtype}, {x.dtype}")
    if B.dim() != 3 or B.shape[1] != weight.shape[0]:
        raise ValueError(f"lora_linear: B must be [S, {weight.shape[0]}, R], got {tuple(B.shape)}")
    T, OUT = x.shape[0], weight.shape[0]
    if partials is None:
        partials = OUT <= PLANES_MAX_OUT
    if gemm not in ("cublas", "triton"):
        raise ValueError(f"lora_linear: gemm must be 'cublas' or 'triton', got {gemm!r}")
    if gemm == "triton":
        if segs.row_slots is None:
            raise ValueError("lora_linear: gemm='triton' needs the segments' row_slots")
        return lora_gemm(x, weight, None, B, segs.row_slots, slot_ranks, out_offsets, scalings, A=A)
    y = torch.empty(T, OUT, dtype=x.dtype, device=x.device)  # the delta's write fills every row
    if pdl is None:
        pdl = pdl_available(x.device)
    h = lora_shrink(x, A, segs, slot_ranks, split_k=split_k, partials=partials,
                    launch_dependents=pdl)  # [(P,) T, n, R] fp32
    lora_expand(y, h, B, segs, slot_ranks, out_offsets, scalings, write=True, pdl=pdl)
    return y.addmm_(x, weight.t())  # beta = 1: cuBLAS reads the delta in its epilogue
