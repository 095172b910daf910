"""rms_norm_lora: a one-slice projection's LoRA expand (o_proj, down_proj) inside the add + RMSNorm after it.

    y = x + delta,  delta[t] = h[t, :r] @ B[slot(t), :, :r]ᵀ   (rounded to x's dtype: lora_expand's add)
    s = y + residual,  out = weight * (s / sqrt(mean(s²) + eps))   (kernels/rms_norm.py's rounding)

for decode steps (one token row per program). The decoder layer's residual add + RMSNorm reads the
projection's output row anyway; adding the delta there saves lora_expand's launch and its read and
write of that output, which on the H200 cost ~10 µs a call at batch 256 for 2-3 µs of bytes (a
latency-bound launch; docs/benchmarks.md round 10). Rows of slot -1 (base tokens, graph padding) and
empty slots (rank 0) add nothing: y = x. B's rank padding is never used (rank_tile).

A program walks its row in BLOCK_N-column steps twice: first x (+ delta) + residual into s, stored,
with the sum of squares; then s read back (this program's own stores), normalised, scaled, stored. B
[H, R] of one adapter does not fit one program's registers beside the row, hence the two passes.
Each row reads its adapter's B: from L2 for every row after the first of that adapter, so this is for
decode-sized steps only (a prefill would read B once per token).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_wait, pdl_launch
from kernels.lora_bodies import rank_tile
from kernels.platform import pdl_available

# Columns a step: B [BLOCK_N, 16] bf16 and the row's x / residual / s tiles, ~40 values a thread at 4 warps.
BLOCK_N = 512
NUM_WARPS = 4


@triton.jit(do_not_specialize=["n_parts", "stride_hp"])
def _rms_norm_lora_kernel(
    x_ptr,  # [T, H] the projection's base output (read only)
    res_ptr,  # [T, H] residual stream in (HAS_RES only)
    w_ptr,  # [H] norm weight
    out_ptr,  # [T, H] normalised rows
    s_ptr,  # [T, H] s = x + delta (+ residual): the new residual stream
    h_ptr,  # [P, T, R] fp32 planes of partial sums from lora_shrink (P = n_parts), summed here
    b_ptr,  # [S, H, R] B of every slot
    row_slot_ptr,  # [T] int32 slot of each row, -1 = none
    rank_ptr,  # [S] int32 true rank per slot
    H, R, n_parts, eps,
    stride_x, stride_r, stride_o, stride_s, stride_ht, stride_hp, stride_bs, stride_bo,
    HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, R8: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (PDL): x is the GEMM's output, h the shrink's
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slot_ptr + t)
    rank = tl.where(slot < 0, 0, tl.load(rank_ptr + tl.maximum(slot, 0)))
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank  # rank 0: nothing of h or B is loaded, the delta is 0
    hv = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for p in range(n_parts):  # the shrink's K splits, added in plane order (as lora_expand)
        hv += tl.load(h_ptr + p * stride_hp + t * stride_ht + offs_r, mask=r_mask, other=0.0)
    dt = x_ptr.dtype.element_ty
    hv = hv.to(b_ptr.dtype.element_ty).to(tl.float32)  # rounded to the weights' dtype, as lora_expand does
    b_row = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + offs_r[None, :]
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK_N):
        offs = c0 + tl.arange(0, BLOCK_N)
        mask = offs < H
        x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
        bt = rank_tile(b_row + offs[:, None] * stride_bo, mask, offs_r, rank, R8, "")  # [BLOCK_N, BLOCK_R]
        delta = tl.sum(bt.to(tl.float32) * hv[None, :], axis=1)
        y = tl.where(rank > 0, (x.to(tl.float32) + delta).to(dt), x)  # lora_expand's add, rounded
        if HAS_RES:
            r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)  # the model's add, rounded
        tl.store(s_ptr + t * stride_s + offs, y, mask=mask)
        yf = y.to(tl.float32)
        sq += yf * yf
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / H + eps)
    tl.debug_barrier()  # the first pass's stores of s, read back below, are this program's own
    for c0 in range(0, H, BLOCK_N):
        offs = c0 + tl.arange(0, BLOCK_N)
        mask = offs < H
        sf = tl.load(s_ptr + t * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
        n = (sf * rstd).to(dt)  # rounded before the scale, as the torch path
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + t * stride_o + offs, (w.to(tl.float32) * n.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=mask)


def rms_norm_lora(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                  h: torch.Tensor, B: torch.Tensor, row_slots: torch.Tensor,
                  slot_ranks: torch.Tensor, *, block_n: Optional[int] = None,
                  num_warps: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """s = (x + delta) + residual; out = weight * (s / sqrt(mean(s²) + eps)) -> (out, s).

    x [T, H] fp32/bf16/fp16 (the base output of a one-slice projection; rows may be strided, columns
    contiguous), left unchanged; weight [H], residual [T, H] or None, both in x's dtype; h [T, 1, R]
    or [P, T, 1, R] fp32 (lora_shrink's output, planes summed here); B [S, H, R] in x's dtype (scale
    folded in, as the engine loads it); row_slots [T] int32 (-1 = no adapter); slot_ranks [S] int32.
    The delta is lora_expand's (add mode) and the rest rms_norm's, with their roundings. Returns
    out and s (new tensors). block_n, num_warps: overrides for benchmarks.
    """
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm_lora: x must be [T, H] and weight [H], got {tuple(x.shape)}, {tuple(weight.shape)}")
    T, H = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.dtype != x.dtype or B.dtype != x.dtype:
        raise ValueError(f"rms_norm_lora: x, weight and B must share one of fp32/bf16/fp16, got {x.dtype}, "
                         f"{weight.dtype}, {B.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"rms_norm_lora: residual must be like x {tuple(x.shape)} {x.dtype}, columns contiguous")
    h4 = h if h.dim() == 4 else h.unsqueeze(0)
    if B.dim() != 3 or B.shape[1] != H or h4.dim() != 4 or h4.shape[1:3] != (T, 1) or h4.shape[3] != B.shape[2]:
        raise ValueError(f"rms_norm_lora: shapes disagree: x {tuple(x.shape)}, h {tuple(h.shape)}, B {tuple(B.shape)}")
    if h.dtype != torch.float32 or not h4.is_contiguous() or not B.is_contiguous():
        raise ValueError("rms_norm_lora: h must be contiguous fp32 (lora_shrink's output) and B contiguous")
    S, R = B.shape[0], B.shape[2]
    if row_slots.shape != (T,) or row_slots.dtype != torch.int32 or slot_ranks.shape != (S,) \
            or slot_ranks.dtype != torch.int32:
        raise ValueError(f"rms_norm_lora: row_slots must be [{T}] and slot_ranks [{S}] int32, got "
                         f"{row_slots.dtype} {tuple(row_slots.shape)}, {slot_ranks.dtype} {tuple(slot_ranks.shape)}")
    for name, t in (("weight", weight), ("residual", residual), ("h", h), ("B", B), ("row_slots", row_slots),
                    ("slot_ranks", slot_ranks)):
        if t is not None and t.device != x.device:
            raise ValueError(f"rms_norm_lora: {name} is on {t.device}, x on {x.device}")
    if x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("rms_norm_lora: the hidden dim of x and weight must be contiguous")
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    s = torch.empty_like(out)
    if T == 0:
        return out, s
    r = residual if residual is not None else x
    pdl = pdl_available(x.device)  # a programmatic dependent of the GEMM before it, as rms_norm
    _rms_norm_lora_kernel[(T,)](
        x, r, weight, out, s, h4, B, row_slots, slot_ranks,
        H, R, h4.shape[0], eps,
        x.stride(0), r.stride(0), out.stride(0), s.stride(0), h4.stride(1), h4.stride(0), B.stride(0), B.stride(1),
        HAS_RES=residual is not None, BLOCK_N=min(block_n or BLOCK_N, triton.next_power_of_2(H)),
        BLOCK_R=max(16, triton.next_power_of_2(R)), R8=R % 8 == 0, num_warps=num_warps or NUM_WARPS,
        **pdl_launch(pdl))
    return out, s
