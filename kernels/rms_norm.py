"""rms_norm: the residual add and the RMSNorm of a decoder layer in one pass over each row.

    s = x + residual (rounded to x's dtype),   out = weight * (s / sqrt(mean(s²) + eps))

A program takes one token row and stores s (the new residual stream) and out, one pass instead of the
torch ops' many kernels. Rounding follows the torch twin exactly: the add rounds to the model dtype,
the rms is fp32 of the rounded sum, the normalised row is rounded before the weight product.
Without a residual (the first layer's input norm) only out is written and s is x.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_wait, pdl_launch
from kernels.platform import pdl_available

# Widest row one program holds in registers (BLOCK = next power of two of H).
MAX_HIDDEN = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H] input rows (a block's output)
    res_ptr,  # [T, H] residual stream in (HAS_RES only)
    w_ptr,  # [H] norm weight, x's dtype
    out_ptr,  # [T, H] normalised rows
    res_out_ptr,  # [T, H] s = x + residual (HAS_RES only)
    H, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (PDL): x and the residual are the previous kernels' output
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the model's add, rounded
        tl.store(res_out_ptr + t * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    n = (xf * rstd).to(x_ptr.dtype.element_ty)  # rounded before the scale, as the torch path
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * n.to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
             residual_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual; out = weight * (s / sqrt(mean(s²) + eps)) -> (out, s).

    x [T, H] fp32/bf16/fp16 (rows may be strided, columns contiguous); weight [H] same dtype;
    residual: optional [T, H] same dtype. out, residual_out: optional [T, H] buffers in x's dtype
    (default: new tensors; residual_out may be residual itself: each element is read before it is
    written). Returns out and s (s is x itself without a residual).
    """
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm: x must be [T, H] and weight [H], got {tuple(x.shape)}, {tuple(weight.shape)}")
    T, H = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x and weight must share one of fp32/bf16/fp16, got {x.dtype}, {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual must be like x {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    for name, t in (("weight", weight), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"rms_norm: {name} is on {t.device}, x on {x.device}")
    if x.stride(1) != 1 or weight.stride(0) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm: the hidden dim of x, residual and weight must be contiguous")
    if H > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {H} exceeds the {MAX_HIDDEN} one program holds")
    for name, t in (("out", out), ("residual_out", residual_out)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype or t.device != x.device
                              or t.stride(1) != 1):
            raise ValueError(f"rms_norm: {name} must be like x {tuple(x.shape)} {x.dtype}, columns contiguous")
    if out is None:
        out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if residual is None:
        s = x
    else:
        s = residual_out if residual_out is not None else torch.empty_like(out)
    if T == 0:
        return out, s
    block = triton.next_power_of_2(H)
    # ~8 to 16 elements per thread
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    r = residual if residual is not None else x
    # A PDL dependent of the GEMM before it: its launch overlaps that GEMM's drain (decode is many short kernels).
    pdl = pdl_available(x.device)
    _rms_norm_kernel[(T,)](
        x, r, weight, out, s, H, eps,
        x.stride(0), r.stride(0), out.stride(0), s.stride(0),
        HAS_RES=residual is not None, BLOCK=block, num_warps=num_warps, **pdl_launch(pdl))
    return out, s
