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
import triton

from kernels.lora_expand import lora_expand
from kernels.lora_gemm import lora_gemm, unfit_reason
from kernels.lora_shrink import lora_shrink
from kernels.platform import pdl_available
from kernels.segments import LoRASegments

# Tokens in a step from which the write-then-accumulate order is used on CUDA: it beat or tied the
# add-after order (GEMM, then lora_apply) from 64 tokens (the fewest measured) for every Llama-3.1-8B
# projection. Below, the step stays with lora_apply after the GEMM.
MIN_TOKENS_CUDA = 64
# Tokens in a step for which lora_linear's automatic choice (gemm=None) is the Triton GEMM with the delta
# in its epilogue (kernels/lora_gemm.py) on sm90+: where it took less LoRA time than the cuBLAS order
# on the Llama-3.1-8B projections. Below 4096 its row tiles are too few to hide the shrink's tiles;
# above 8192 cuBLAS's GEMM pulls ahead for qkv and gate_up. (In the engine, gate_up_proj under the
# fused kernels takes neither order: its delta goes inside the activation, kernels/silu_mul_lora.py,
# appliance/lora/layers.py's forward_deferred.)
TRITON_GEMM_TOKENS = (4096, 8192)
# Up to this many tokens for outputs at most NARROW_OUT wide (o_proj, down_proj: 4096 columns), where
# lora_gemm still won at 16384 tokens; qkv_proj (6144 columns) did not.
TRITON_GEMM_TOKENS_NARROW = 16384
NARROW_OUT = 4096
_REFUSED: set = set()  # shapes whose lora_gemm launch ran out of resources on their device
# Output width up to which the shrink's K splits leave planes of partial sums (summed by the expand)
# rather than adding atomically into a zeroed h. Every expand program re-reads all planes of its
# rows, and wide outputs have many column programs: planes won or tied for qkv/o/down_proj, atomics
# for gate_up_proj (28672 columns).
PLANES_MAX_OUT = 8192


def lora_linear_pays(num_tokens: int, segs: LoRASegments, device: torch.device) -> bool:
    """Whether a step should run its wrapped projections through lora_linear (host ints only, no sync):
    multi-token segments (prefill-shaped) and, on CUDA, enough tokens for the GEMM to be compute bound.
    On CPU (Triton's interpreter) every prefill-shaped step does, so the CPU tests run this path."""
    if segs.max_len <= 1 or segs.base_rows is None:
        return False
    return device.type != "cuda" or num_tokens >= MIN_TOKENS_CUDA


def triton_gemm_pays(x: torch.Tensor, weight: torch.Tensor, out_offsets: Sequence[int], segs: LoRASegments) -> bool:
    """lora_linear's automatic path choice (host facts only, no sync): the Triton GEMM on a CUDA device
    for TRITON_GEMM_TOKENS (up to TRITON_GEMM_TOKENS_NARROW for outputs at most NARROW_OUT wide), when
    the platform and operands fit it (kernels/lora_gemm.unfit_reason)."""
    T = x.shape[0]
    hi = TRITON_GEMM_TOKENS_NARROW if weight.shape[0] <= NARROW_OUT else TRITON_GEMM_TOKENS[1]
    if x.device.type != "cuda" or not TRITON_GEMM_TOKENS[0] <= T <= hi or segs.row_slots is None:
        return False
    return unfit_reason(x, weight, out_offsets) is None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
                slot_ranks: torch.Tensor, out_offsets: Sequence[int],
                scalings: Optional[torch.Tensor] = None, *, split_k: Optional[int] = None,
                partials: Optional[bool] = None, pdl: Optional[bool] = None,
                gemm: Optional[str] = None) -> torch.Tensor:
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
    segs.row_slots; split_k, partials and pdl do not apply); None = triton where triton_gemm_pays, else
    cublas.
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
    auto = gemm is None
    if auto:
        gemm = "triton" if triton_gemm_pays(x, weight, out_offsets, segs) else "cublas"
    if gemm not in ("cublas", "triton"):
        raise ValueError(f"lora_linear: gemm must be 'cublas' or 'triton', got {gemm!r}")
    if gemm == "triton":
        if segs.row_slots is None:
            raise ValueError("lora_linear: gemm='triton' needs the segments' row_slots")
        key = (x.device, x.dtype, tuple(weight.shape), tuple(out_offsets), A.shape[2])
        if key not in _REFUSED:
            try:
                return lora_gemm(x, weight, None, B, segs.row_slots, slot_ranks, out_offsets, scalings, A=A)
            except triton.runtime.errors.OutOfResources:
                if not auto:
                    raise
                # A GPU with less shared memory than the tiles were sized for: the automatic choice
                # falls back to the cuBLAS order for this shape from now on, instead of failing the step.
                _REFUSED.add(key)
    y = torch.empty(T, OUT, dtype=x.dtype, device=x.device)  # the delta's write fills every row
    if pdl is None:
        pdl = pdl_available(x.device)
    h = lora_shrink(x, A, segs, slot_ranks, split_k=split_k, partials=partials,
                    launch_dependents=pdl)  # [(P,) T, n, R] fp32
    lora_expand(y, h, B, segs, slot_ranks, out_offsets, scalings, write=True, pdl=pdl)
    return y.addmm_(x, weight.t())  # beta = 1: cuBLAS reads the delta in its epilogue
