"""lora_expand: the second half of a multi-LoRA projection, fused with the add into the base output.

    y[t, o_i + c] += scale[slot(t)] * sum_{j < rank[slot(t)]} h[t, i*R + j] * B[slot(t), o_i + c, j]

for every slice i of the fused output (columns o_i:o_{i+1}), adapter tokens t, in place, one launch.
The grid tiles the whole output width; a tile that straddles a slice boundary (slice sizes need not
be multiples of the tile) runs one small dot per slice it touches, each with the right h columns.
The rank loop stops at the slot's true rank, so padding up to max_lora_rank is never read, and base
tokens have no segment (kernels/segments.py): their rows of y are not touched.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kernels.platform import dot_upcast
from kernels.segments import LoRASegments, check_segments, check_tile


@triton.jit(do_not_specialize=["tiles_per_seg"])  # varies every step: no recompiles
def _lora_expand_kernel(
    y_ptr,  # [T, OUT] base output, updated in place
    h_ptr,  # [T, n*R] fp32 from lora_shrink
    b_ptr,  # [S, OUT, R] B of every slot
    scale_ptr,  # [S] fp32 scale per slot (HAS_SCALE only)
    tok_ptr,  # [P] int32 token row per position (GATHER only)
    seg_start_ptr,  # [G] int32
    seg_len_ptr,  # [G] int32
    seg_slot_ptr,  # [G] int32
    rank_ptr,  # [S] int32 true rank per slot
    OUT, R, o1, o2,  # output width, max rank, first column of slices 1 and 2 (= OUT when absent)
    stride_yt, stride_yo, stride_ht, stride_hn, stride_bs, stride_bo, stride_br,
    tiles_per_seg,
    N_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = pid // tiles_per_seg
    m0 = (pid % tiles_per_seg) * BLOCK_M
    seg_len = tl.load(seg_len_ptr + seg)
    if m0 >= seg_len:
        return
    slot = tl.load(seg_slot_ptr + seg)
    rank = tl.load(rank_ptr + slot)
    if rank == 0:
        return  # empty slot: nothing to add
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    pos = tl.load(seg_start_ptr + seg) + offs_m
    if GATHER:
        rows = tl.load(tok_ptr + pos, mask=m_mask, other=0)
    else:
        rows = pos
    rows64 = rows.to(tl.int64)
    c0 = tl.program_id(1) * BLOCK_N
    offs_c = c0 + tl.arange(0, BLOCK_N)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.static_range(N_SLICES):
        if i == 0:
            lo = 0
            hi = o1
        elif i == 1:
            lo = o1
            hi = o2
        else:
            lo = o2
            hi = OUT
        if (lo < c0 + BLOCK_N) & (hi > c0):  # this tile holds columns of slice i
            c_mask = (offs_c >= lo) & (offs_c < hi)
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < rank
                ht = tl.load(h_ptr + rows64[:, None] * stride_ht + (i * R + offs_r)[None, :] * stride_hn,
                             mask=m_mask[:, None] & r_mask[None, :], other=0.0)
                bt = tl.load(b_base + offs_c[None, :] * stride_bo + offs_r[:, None] * stride_br,
                             mask=c_mask[None, :] & r_mask[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]
                ht = ht.to(bt.dtype)  # h rounded to the weights' dtype, as the torch twin does
                if UPCAST:
                    ht = ht.to(tl.float32)
                    bt = bt.to(tl.float32)
                acc += tl.dot(ht, bt, input_precision=PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + rows64[:, None] * stride_yt + offs_c[None, :] * stride_yo
    y_mask = m_mask[:, None] & (offs_c < OUT)[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=y_mask)


def lora_expand(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, segs: LoRASegments, slot_ranks: torch.Tensor,
                out_offsets: Sequence[int], scalings: Optional[torch.Tensor] = None, *,
                block_m: Optional[int] = None, block_n: Optional[int] = None,
                num_warps: Optional[int] = None) -> torch.Tensor:
    """y[t, o_i:o_{i+1}] += scale[slot(t)] * h[t, i, :r] @ B[slot(t), o_i:o_{i+1}, :r]ᵀ, every slice i, in place.

    y [T, out] fp32/bf16/fp16 (row stride free, unit column stride); h [T, n, R] fp32 from lora_shrink;
    B [S, out, R] in y's dtype; segs over the adapter tokens; slot_ranks [S] int32 (r above);
    out_offsets [n + 1] host ints, 0 .. out, n <= 3; scalings [S] fp32 or None (= 1: the engine folds
    each module's alpha/r into B, since rank_pattern/alpha_pattern make it per module, not per slot).
    Returns y. Rows of tokens outside every segment are left exactly as they were.
    block_m, block_n, num_warps: tile overrides for benchmarks (None = the launcher's choice).
    """
    if y.dim() != 2 or h.dim() != 3 or B.dim() != 3:
        raise ValueError(f"lora_expand: y must be [T, out], h [T, n, R], B [S, out, R]; got "
                         f"{tuple(y.shape)}, {tuple(h.shape)}, {tuple(B.shape)}")
    T, OUT = y.shape
    S, OUT_b, R = B.shape
    n = h.shape[1]
    if h.shape != (T, n, R) or OUT_b != OUT:
        raise ValueError(f"lora_expand: shapes disagree: y {tuple(y.shape)}, h {tuple(h.shape)}, B {tuple(B.shape)}")
    if h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError(f"lora_expand: h must be contiguous fp32 (lora_shrink's output), got {h.dtype}")
    if y.dtype != B.dtype or y.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"lora_expand: y and B must share one of fp32/bf16/fp16, got {y.dtype}, {B.dtype}")
    if y.stride(1) != 1:
        raise ValueError("lora_expand: y's columns must be contiguous")
    offs = list(out_offsets)
    if len(offs) != n + 1 or offs[0] != 0 or offs[-1] != OUT or any(a >= b for a, b in zip(offs, offs[1:])):
        raise ValueError(f"lora_expand: out_offsets {offs} must rise from 0 to {OUT} in {n} slices")
    if not 1 <= n <= 3:
        raise ValueError(f"lora_expand: 1 to 3 slices supported, got {n}")
    check_segments(segs, slot_ranks, S, y.device)
    if scalings is not None and (scalings.shape != (S,) or scalings.dtype != torch.float32
                                 or scalings.device != y.device):
        raise ValueError(f"lora_expand: scalings must be fp32 [{S}] on {y.device}")
    G = segs.num_segs
    if G == 0 or T == 0:
        return y
    decode = segs.max_len <= 16
    if block_m is None:
        block_m = 16 if decode else (32 if segs.max_len <= 32 else 64)
    if block_n is None:
        # Decode: 128 and 256 columns measured alike on the H200; prefill tiles are bounded by the
        # fp32 accumulator [BLOCK_M, BLOCK_N] in registers (64 x 256 was slower).
        block_n = min(256 if decode else 128, max(16, triton.next_power_of_2(OUT)))
    if num_warps is None:
        num_warps = 4  # 8 warps measured slower for prefill tiles (gate_up 16k: 701 vs 608 µs)
    check_tile(block_m=block_m, block_n=block_n)
    block_r = min(64, max(16, triton.next_power_of_2(R)))
    tiles_per_seg = triton.cdiv(segs.max_len, block_m)
    o1 = offs[1] if n > 1 else OUT
    o2 = offs[2] if n > 2 else OUT
    tok = segs.token_index if segs.token_index is not None else segs.starts
    grid = (G * tiles_per_seg, triton.cdiv(OUT, block_n))
    _lora_expand_kernel[grid](
        y, h, B, scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.lens, segs.slots, slot_ranks,
        OUT, R, o1, o2,
        y.stride(0), y.stride(1), h.stride(0), h.stride(2), B.stride(0), B.stride(1), B.stride(2),
        tiles_per_seg,
        N_SLICES=n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        GATHER=segs.token_index is not None, HAS_SCALE=scalings is not None,
        PRECISION="ieee" if y.dtype == torch.float32 else "tf32", UPCAST=dot_upcast(y.dtype),
        num_warps=num_warps,
    )
    return y
