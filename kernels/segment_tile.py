"""The segment prologue every multi-LoRA kernel starts with, as @triton.jit helpers (inlined).

A program along grid axis 0 owns BLOCK_M positions of one segment (kernels/segments.py):

    segment_tile(pid)  -> (seg, m0, seg_len, slot, rank)   slot -1 (padding) gives rank 0   pid = seg * tiles_per_seg + m0 / BLOCK_M
    segment_row(...)   -> the token row (int64 scalar) of position m0 (one-token bodies)
    segment_rows(...)  -> rows [BLOCK_M] int64 and mask [BLOCK_M] of positions m0 .. m0 + BLOCK_M

A position maps to token row start + p (SGMV) or token_index[start + p] (chunked SGMV, GATHER).
The caller returns early when m0 >= seg_len (a tile past a shorter segment's end): a helper cannot
end its caller's program.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def segment_tile(pid, tiles_per_seg, seg_len_ptr, seg_slot_ptr, rank_ptr, BLOCK_M: tl.constexpr):
    seg = pid // tiles_per_seg
    m0 = (pid % tiles_per_seg) * BLOCK_M
    seg_len = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    # 0 = empty slot; slot -1 = a padding row of a static (CUDA-graph) decode batch: rank 0 as well
    rank = tl.where(slot < 0, 0, tl.load(rank_ptr + tl.maximum(slot, 0)))
    return seg, m0, seg_len, slot, rank


@triton.jit
def segment_row(seg_start_ptr, tok_ptr, seg, m0, GATHER: tl.constexpr):
    pos = tl.load(seg_start_ptr + seg) + m0
    if GATHER:
        row = tl.load(tok_ptr + pos).to(tl.int64)
    else:
        row = pos.to(tl.int64)
    return row


@triton.jit
def segment_rows(seg_start_ptr, tok_ptr, seg, m0, seg_len, BLOCK_M: tl.constexpr, GATHER: tl.constexpr):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    pos = tl.load(seg_start_ptr + seg) + offs_m
    if GATHER:
        rows = tl.load(tok_ptr + pos, mask=m_mask, other=0).to(tl.int64)
    else:
        rows = pos.to(tl.int64)
    return rows, m_mask
