"""The one-token (GEMV) loops the multi-LoRA kernels share, as @triton.jit helpers (inlined into each caller).

    gemv_shrink(...) -> [BLOCK_N] fp32       h = x[row, k_lo:k_hi] · A rows          one token
    gemv_expand(...)                         y[row, c_lo:c_hi] (+)= B[c, :] · h       one token

Callers: lora_shrink and lora_expand for one-token segments (BLOCK_M = 1), and lora_apply's fused
kernel (both). One body per loop, so a tuning or rounding fix lands in every kernel at once.

The GEMV bodies read the weights in their own layout (A: [BLOCK_N, BLOCK_K] tiles, K contiguous;
B: [BLOCK_N, BLOCK_R] tiles, R contiguous) and reduce in fp32 registers: a one-token tl.dot would
leave 15/16 of the tensor-core tile empty. Masked lanes (rank padding, past the end) are never
loaded, so NaN or garbage there cannot leak. The scale is folded into h by the caller.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_shrink(x_row_ptr, a_rows, row_mask, k_lo, k_hi, stride_xk, stride_ak,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k x[k] * A[n, k] over k_lo <= k < k_hi for the BLOCK_N rows a_rows (masked by row_mask).

    Products are summed elementwise in a [BLOCK_N, BLOCK_K] fp32 tile and reduced over K once at the
    end (no cross-thread reduction inside the loop). Double-buffering this loop (and gemv_expand's)
    by hand, tile k+1 loaded before tile k's products, was much slower on the H200 (fused decode
    kernel, 256 tokens / 256 adapters: o_proj 41 against 33 µs, down_proj 85 against 54;
    docs/benchmarks.md, round 4): the compiler pipelines these loads itself (num_stages)."""
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
def gemv_expand(y_row_ptr, b_ptr, hv, offs_r, r_mask, c_lo, c_hi, stride_yo, stride_bo, stride_br,
                BLOCK_N: tl.constexpr, WRITE: tl.constexpr):
    """y[c] (+)= sum_r B[c, r] * hv[r] for c_lo <= c < c_hi, BLOCK_N columns a step.

    b_ptr: B of the slot; hv [BLOCK_R] fp32 (scale folded in, 0 beyond the rank); WRITE: y is only
    written (no read), else read, added in fp32, written back. c_lo >= c_hi: nothing."""
    for c0 in range(c_lo, c_hi, BLOCK_N):
        offs_c = c0 + tl.arange(0, BLOCK_N)
        c_mask = offs_c < c_hi
        bt = tl.load(b_ptr + offs_c[:, None] * stride_bo + offs_r[None, :] * stride_br,
                     mask=c_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        y_ptrs = y_row_ptr + offs_c * stride_yo
        if WRITE:
            acc = tl.sum(bt.to(tl.float32) * hv[None, :], axis=1)  # [BLOCK_N] fp32
            tl.store(y_ptrs, acc.to(y_row_ptr.dtype.element_ty), mask=c_mask)
        else:
            # y is loaded before the reduction that waits on B: both loads in flight at once. Loaded
            # after it (one more DRAM round trip per step), the fused decode kernel lost 5-20 %
            # (H200, gate_up_proj 256 tokens / 256 adapters: 122 against 102 µs; docs/benchmarks.md).
            y = tl.load(y_ptrs, mask=c_mask, other=0.0)
            acc = tl.sum(bt.to(tl.float32) * hv[None, :], axis=1)  # [BLOCK_N] fp32
            tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=c_mask)
