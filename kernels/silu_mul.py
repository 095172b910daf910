"""silu_mul: the MLP's activation on the fused gate_up output, one pass.

    out[t, j] = silu(gate_up[t, j]) * gate_up[t, I + j],   silu(g) = g / (1 + exp(-g))

gate_up [T, 2I] is gate | up as MergedLinear writes it; one program a row and BLOCK columns, no
intermediate [T, I]. SiLU in fp32, rounded before the product, as `F.silu(gate) * up` rounds.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_wait, pdl_launch
from kernels.platform import pdl_available


@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [T, 2I] gate | up
    out_ptr,  # [T, I]
    I, stride_x, stride_o,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (PDL, as rms_norm): gate_up is the GEMM's output
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # F.silu's fp32 math, rounded
    tl.store(out_ptr + t * stride_o + offs, (act.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: Optional[torch.Tensor] = None, block: int = 1024) -> torch.Tensor:
    """out = silu(gate) * up for gate_up [T, 2I] = gate | up.

    gate_up [T, 2I] fp32/bf16/fp16 (rows may be strided, columns contiguous); out: optional [T, I]
    buffer in gate_up's dtype (default: a new tensor). Returns out [T, I]. block: columns per
    program (a power of two >= 16).
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"silu_mul: gate_up must be fp32/bf16/fp16, got {gate_up.dtype}")
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul: the columns of gate_up must be contiguous")
    if block < 16 or block & (block - 1):
        raise ValueError(f"silu_mul: block must be a power of two >= 16, got {block}")
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (T, I) or out.dtype != gate_up.dtype or out.device != gate_up.device or out.stride(1) != 1:
        raise ValueError(f"silu_mul: out must be [{T}, {I}] {gate_up.dtype}, columns contiguous; got "
                         f"{out.dtype} {tuple(out.shape)}")
    if T == 0 or I == 0:
        return out
    block = min(block, max(16, triton.next_power_of_2(I)))
    pdl = pdl_available(gate_up.device)
    _silu_mul_kernel[(T, triton.cdiv(I, block))](gate_up, out, I, gate_up.stride(0), out.stride(0),
                                                 BLOCK=block, num_warps=4, **pdl_launch(pdl))
    return out
