"""The one-token (GEMV) loops the multi-LoRA kernels share, as @triton.jit helpers (inlined into each caller).

    gemv_shrink(...) -> [BLOCK_N] fp32       h = x[row, k_lo:k_hi] · A rows          one token
    gemv_expand(...)                         y[row, c_lo:c_hi] (+)= B[c, :] · h       one token
    rank_tile(ptrs, row_mask, ...) -> tile   [ROWS, BLOCK_R] of B or h, 0 past the rank   every body
    plane_sum(ptrs, row_mask, ...) -> tile   [ROWS, BLOCK_R] h: the shrink's K-split planes summed   tile bodies

Shared by lora_shrink, lora_expand (BLOCK_M = 1) and lora_apply's fused kernel, so a tuning or
rounding fix lands everywhere at once. The GEMV bodies read weights in their own layout and reduce in
fp32 registers (a one-token tl.dot would leave the tensor-core tile mostly empty). The caller folds
the scale into h.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rank_tile(ptrs, row_mask, offs_r, rank, R8: tl.constexpr, CACHE: tl.constexpr):
    """[ROWS, BLOCK_R] of B or h (rank contiguous): rows where row_mask, columns from `rank` on 0.

    Loaded up to the rank rounded to 8 when R8, so the constant mask allows 16-byte loads; padding may
    hold NaN and is zeroed in registers. CACHE is passed by every caller: some tritons do not make a
    jit helper's default argument a constexpr."""
    if R8:
        cols = offs_r < tl.cdiv(rank, 8) * 8
    else:
        cols = offs_r < rank
    t = tl.load(ptrs, mask=row_mask[:, None] & cols[None, :], other=0.0, cache_modifier=CACHE)
    return tl.where((offs_r < rank)[None, :], t, 0.0)


@triton.jit
def plane_sum(ptrs, row_mask, offs_r, rank, n_parts, stride_hp, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
              R8: tl.constexpr, UNROLL: tl.constexpr):
    """sum over p < n_parts of rank_tile(ptrs + p * stride_hp, ...), in plane order so every reader's
    rounding agrees. UNROLL > 0 (>= n_parts): all loads issued before the first add; planes past
    n_parts add +0.0, a no-op. UNROLL = 0: a loop (tall tiles would hold too many registers unrolled)."""
    acc = tl.zeros((ROWS, BLOCK_R), dtype=tl.float32)
    if UNROLL > 0:
        for p in tl.static_range(UNROLL):
            live = tl.full((ROWS,), p, tl.int32) < n_parts  # a tensor: n_parts may be a host int here
            acc += rank_tile(ptrs + p * stride_hp, row_mask & live, offs_r, rank, R8, "")
    else:
        for p in range(n_parts):
            acc += rank_tile(ptrs + p * stride_hp, row_mask, offs_r, rank, R8, "")
    return acc


@triton.jit
def gemv_shrink(x_row_ptr, a_rows, row_mask, k_lo, k_hi, stride_xk, stride_ak,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k x[k] * A[n, k] over k_lo <= k < k_hi for the BLOCK_N rows a_rows (masked by row_mask).

    Summed elementwise in fp32 and reduced over K once at the end; do not double-buffer by hand,
    the compiler pipelines these loads itself (num_stages)."""
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xv = tl.load(x_row_ptr + offs_k * stride_xk, mask=k_mask, other=0.0)
        at = tl.load(a_rows[:, None] + offs_k[None, :] * stride_ak, mask=row_mask[:, None] & k_mask[None, :],
                     other=0.0)
        acc2 += at.to(tl.float32) * xv.to(tl.float32)[None, :]
    return tl.sum(acc2, axis=1)


@triton.jit
def gemv_expand(y_row_ptr, b_ptr, hv, offs_r, rank, c_lo, c_hi, stride_yo, stride_bo, stride_br,
                BLOCK_N: tl.constexpr, WRITE: tl.constexpr, R8: tl.constexpr):
    """y[c] (+)= sum_r B[c, r] * hv[r] for c_lo <= c < c_hi, BLOCK_N columns a step.

    hv [BLOCK_R] fp32, scale folded in, 0 beyond the rank; WRITE: y is only written, never read."""
    for c0 in range(c_lo, c_hi, BLOCK_N):
        offs_c = c0 + tl.arange(0, BLOCK_N)
        c_mask = offs_c < c_hi
        bt = rank_tile(b_ptr + offs_c[:, None] * stride_bo + offs_r[None, :] * stride_br, c_mask, offs_r, rank,
                       R8, "")  # [BLOCK_N, BLOCK_R]
        y_ptrs = y_row_ptr + offs_c * stride_yo
        if WRITE:
            acc = tl.sum(bt.to(tl.float32) * hv[None, :], axis=1)  # [BLOCK_N] fp32
            tl.store(y_ptrs, acc.to(y_row_ptr.dtype.element_ty), mask=c_mask)
        else:
            # y is loaded before the reduction that waits on B: both loads in flight at once. Loaded
            # after it, each step pays one more DRAM round trip.
            y = tl.load(y_ptrs, mask=c_mask, other=0.0)
            acc = tl.sum(bt.to(tl.float32) * hv[None, :], axis=1)  # [BLOCK_N] fp32
            tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=c_mask)
