"""lora_linear: a whole LoRA-wrapped projection for prefill-shaped steps, the delta under the base GEMM.

    y[t] = x[t] @ Wᵀ + scale[slot(t)] * (x[t] @ A[slot(t), i, :r]ᵀ) @ B[slot(t), o_i:o_{i+1}, :r]ᵀ  (slices i)

The add-after order moves y through HBM twice more than the GEMM; here lora_shrink, then lora_expand
in write mode (y = the delta, base rows zeroed), then cuBLAS accumulates x @ Wᵀ into y, reading C in
its epilogue almost free. Rounding differs by one step: the delta is rounded to y's dtype first.
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

    x [T, in], weight [out, in] (no bias), A [S, n, R, in], B [S, out, R], one dtype; segs must list base
    rows; slot_ranks [S] int32; out_offsets [n + 1]; scalings [S] fp32 or None. split_k/partials/pdl
    override the shrink's K split, its combine (planes or atomics) and PDL; gemm "triton" runs
    kernels/lora_gemm.py instead of cuBLAS. Which pays is appliance/lora/backend/policy.py's choice.
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
