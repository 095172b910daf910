"""lora_delta: a prefill step's whole multi-LoRA delta written into y in one pass (shrink, then expand).

    y[t, o_i:o_{i+1}] = scale[slot(t)] * (x[t] @ A[slot(t), i, :r]ᵀ) @ B[slot(t), o_i:o_{i+1}, :r]ᵀ   (adapter tokens)
    y[t] = 0                                                                                         (base tokens)

What lora_shrink followed by lora_expand's write mode computes, with the same rounding (h summed in
fp32, rounded to the weights' dtype before the expand), in one launch: a program owns BLOCK_M rows of
one segment, streams their x rows once against every slice's A (one x tile feeds n tl.dot's, h_i
[BLOCK_M, R] stays in registers), then walks its output columns slice by slice and writes
h_i @ B_iᵀ. No h round trip and no second launch, and the x reads of some programs overlap the y
writes of others, where the two kernels apart each stream one direction (H200, docs/benchmarks.md:
the shrink reads x at ~77 % of the copy bandwidth, the write-only expand runs at memset speed).
kernels/lora_linear.py then accumulates the base GEMM into y.

Grid: (segment x BLOCK_M tile + base-row zeroing programs, column split). A column split recomputes
h (x read again, mostly from L2): only for steps with too few row tiles to fill the SMs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kernels.lora_bodies import dot_expand
from kernels.lora_expand import check_out_slices
from kernels.platform import dot_upcast
from kernels.segment_tile import segment_rows, segment_tile, zero_base_rows
from kernels.segments import LoRASegments, check_tile


@triton.jit
def _slice_dot(acc, xt, a_base, i, R, offs_k, k_mask, offs_r, r_mask, stride_an, stride_ak,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc [BLOCK_M, BLOCK_R] += x tile @ A[slot, slice i, :, k tile]ᵀ."""
    at = tl.load(a_base + (i * R + offs_r)[None, :] * stride_an + offs_k[:, None] * stride_ak,
                 mask=r_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
    if UPCAST:
        at = at.to(tl.float32)
    return acc + tl.dot(xt, at, input_precision=PRECISION)


@triton.jit(do_not_specialize=["tiles_per_seg", "num_base"])  # vary every step: no recompiles
def _lora_delta_kernel(
    y_ptr,  # [T, OUT] output, only written
    x_ptr,  # [T, K] input rows
    a_ptr,  # [S, N, K] A of every slot, N = n*R: row i*R + j = rank row j of slice i
    b_ptr,  # [S, OUT, R] B of every slot
    scale_ptr,  # [S] fp32 scale per slot (HAS_SCALE only)
    tok_ptr,  # [P] int32 token row per position (GATHER only)
    seg_start_ptr, seg_len_ptr, seg_slot_ptr,  # [G] int32
    rank_ptr,  # [S] int32 true rank per slot
    base_ptr,  # [num_base] int32 rows of base tokens: zeroed, ZERO_M rows a program
    K, OUT, R, o1, o2,  # in features, out features, max rank, first column of slices 1 and 2 (= OUT when absent)
    cols_per_prog,  # output columns of one program along grid axis 1
    stride_xt, stride_xk, stride_as, stride_an, stride_ak,
    stride_yt, stride_yo, stride_bs, stride_bo, stride_br,
    tiles_per_seg, num_base,
    N_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, ZERO_M: tl.constexpr, GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    p_lo = tl.program_id(1) * cols_per_prog
    p_hi = tl.minimum(p_lo + cols_per_prog, OUT)
    n_seg_progs = tl.num_programs(0) - tl.cdiv(num_base, ZERO_M)
    if pid >= n_seg_progs:
        zero_base_rows(y_ptr, base_ptr, pid - n_seg_progs, num_base, p_lo, p_hi, stride_yt, stride_yo,
                       ZERO_M, BLOCK_N)
        return
    seg, m0, seg_len, slot, rank = segment_tile(pid, tiles_per_seg, seg_len_ptr, seg_slot_ptr, rank_ptr, BLOCK_M)
    if m0 >= seg_len:
        return
    rows, m_mask = segment_rows(seg_start_ptr, tok_ptr, seg, m0, seg_len, BLOCK_M, GATHER)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    # shrink: one x tile per K step feeds every slice's dot; an empty slot (rank 0) reads no x at all
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    x_rows = x_ptr + rows[:, None] * stride_xt
    h0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    h1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    h2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_end = tl.where(rank > 0, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
        h0 = _slice_dot(h0, xt, a_base, 0, R, offs_k, k_mask, offs_r, r_mask, stride_an, stride_ak, PRECISION,
                        UPCAST)
        if N_SLICES > 1:
            h1 = _slice_dot(h1, xt, a_base, 1, R, offs_k, k_mask, offs_r, r_mask, stride_an, stride_ak, PRECISION,
                            UPCAST)
        if N_SLICES > 2:
            h2 = _slice_dot(h2, xt, a_base, 2, R, offs_k, k_mask, offs_r, r_mask, stride_an, stride_ak, PRECISION,
                            UPCAST)
    # expand (write): this program's columns, slice by slice
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    b_ty = b_ptr.dtype.element_ty
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + tl.maximum(slot, 0))
    for i in tl.static_range(N_SLICES):
        if i == 0:
            lo = 0
            hi = o1
            ht = h0.to(b_ty)  # h rounded to the weights' dtype, as lora_expand and the torch twin do
        elif i == 1:
            lo = o1
            hi = o2
            ht = h1.to(b_ty)
        else:
            lo = o2
            hi = OUT
            ht = h2.to(b_ty)
        if UPCAST:
            ht = ht.to(tl.float32)
        dot_expand(y_ptr, rows, m_mask, ht, b_base, offs_r, r_mask, tl.maximum(lo, p_lo), tl.minimum(hi, p_hi),
                   scale, stride_yt, stride_yo, stride_bo, stride_br, BLOCK_N, True, PRECISION, UPCAST)


def lora_delta(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
               slot_ranks: torch.Tensor, out_offsets: Sequence[int], scalings: Optional[torch.Tensor] = None, *,
               block_m: Optional[int] = None, block_n: Optional[int] = None, block_k: Optional[int] = None,
               cols_per_prog: Optional[int] = None, num_warps: Optional[int] = None,
               num_stages: Optional[int] = None) -> torch.Tensor:
    """y = the delta (adapter tokens) and 0 (base tokens in segs.base_rows); y is only written. Returns y.

    x [T, in], A [S, n, R, in], y [T, out], B [S, out, R], all one dtype (fp32/bf16/fp16); segs from
    kernels/segments.py's builders; every row of y must be an adapter token or a listed base token.
    slot_ranks, out_offsets, scalings as for lora_expand. block_m (a power of two >= 16), block_n,
    block_k, cols_per_prog (a multiple of block_n), num_warps, num_stages: tile overrides for
    benchmarks (None = the launcher's choice).
    """
    if x.dim() != 2 or A.dim() != 4 or y.dim() != 2 or B.dim() != 3:
        raise ValueError(f"lora_delta: x must be [T, in], A [S, n, R, in], y [T, out], B [S, out, R]; got "
                         f"{tuple(x.shape)}, {tuple(A.shape)}, {tuple(y.shape)}, {tuple(B.shape)}")
    T, K = x.shape
    S, n, R, K_a = A.shape
    OUT = y.shape[1]
    if K_a != K or y.shape[0] != T or B.shape != (S, OUT, R):
        raise ValueError(f"lora_delta: shapes disagree: x {tuple(x.shape)}, A {tuple(A.shape)}, "
                         f"y {tuple(y.shape)}, B {tuple(B.shape)}")
    if not (x.dtype == A.dtype == y.dtype == B.dtype) or x.dtype not in (torch.float32, torch.bfloat16,
                                                                         torch.float16):
        raise ValueError(f"lora_delta: x, A, y and B must share one of fp32/bf16/fp16, got "
                         f"{x.dtype}, {A.dtype}, {y.dtype}, {B.dtype}")
    if not A.is_contiguous():
        raise ValueError("lora_delta: A must be contiguous (its [n, R] dims are read as one)")
    offs = check_out_slices("lora_delta", y, out_offsets, n, R, segs, slot_ranks, S, scalings)
    if segs.base_rows is None:
        raise ValueError("lora_delta: needs segs.base_rows (the builders in kernels/segments.py set it)")
    num_base = segs.base_rows.shape[0]
    if segs.num_rows + num_base != T:
        raise ValueError(f"lora_delta: the segments must cover every row of y: {segs.num_rows} adapter + "
                         f"{num_base} base rows != {T}")
    G = segs.num_segs
    if (G == 0 and num_base == 0) or T == 0:
        return y
    if block_m is None:
        block_m = 16 if segs.max_len <= 16 else (32 if segs.max_len <= 32 else 64)
    if block_k is None:
        block_k = 64
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    if block_n is None:
        block_n = 128
    block_n = min(block_n, max(16, triton.next_power_of_2(OUT)))
    check_tile(block_m=block_m, block_n=block_n, block_k=block_k)
    block_r = max(16, triton.next_power_of_2(R))
    tiles_per_seg = triton.cdiv(segs.max_len, block_m) if G else 0
    zero_m = block_m
    programs_m = G * tiles_per_seg + triton.cdiv(num_base, zero_m)
    if cols_per_prog is None:
        cols_per_prog = _auto_cols_per_prog(G * tiles_per_seg, OUT, block_n, y.device)
    if cols_per_prog % block_n:
        raise ValueError(f"lora_delta: cols_per_prog {cols_per_prog} must be a multiple of block_n {block_n}")
    a3 = A.view(S, n * R, K)
    o1 = offs[1] if n > 1 else OUT
    o2 = offs[2] if n > 2 else OUT
    tok = segs.token_index if segs.token_index is not None else segs.starts
    base = segs.base_rows if num_base else slot_ranks  # a valid int32 pointer; not read when num_base = 0
    grid = (programs_m, triton.cdiv(OUT, cols_per_prog))
    _lora_delta_kernel[grid](
        y, x, a3, B, scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.lens, segs.slots,
        slot_ranks, base,
        K, OUT, R, o1, o2, cols_per_prog,
        x.stride(0), x.stride(1), a3.stride(0), a3.stride(1), a3.stride(2),
        y.stride(0), y.stride(1), B.stride(0), B.stride(1), B.stride(2),
        max(tiles_per_seg, 1), num_base,
        N_SLICES=n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, ZERO_M=zero_m,
        GATHER=segs.token_index is not None, HAS_SCALE=scalings is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=dot_upcast(x.dtype),
        num_warps=num_warps or 4, num_stages=num_stages or 3,
    )
    return y


def _auto_cols_per_prog(row_tiles: int, OUT: int, block_n: int, device: torch.device) -> int:
    """All columns in one program when the row tiles cover the SMs; else split the columns until the
    programs do (each split reads its rows of x again, mostly from L2)."""
    n_steps = triton.cdiv(OUT, block_n)
    if device.type != "cuda":
        return n_steps * block_n  # interpreter: fewest programs
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(n_steps, triton.cdiv(sms, max(row_tiles, 1))))
    return triton.cdiv(n_steps, splits) * block_n
