"""lora_apply: a whole multi-LoRA projection delta, shrink then expand, in place into the base output.

    y[t, o_i:o_{i+1}] += scale[slot(t)] * (x[t] @ A[slot(t), i, :r]ᵀ) @ B[slot(t), o_i:o_{i+1}, :r]ᵀ

with lora_shrink + lora_expand's rounding. When every segment is one token, one fused launch does it:
a program per (token, slice) keeps h_i in registers (no h round trip, no zeroing, no atomics). Its TMA
body (sm90+) gets pipelined loads; the pointer body does not. Otherwise shrink then expand.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kernels.lora_expand import check_out_slices, lora_expand
from kernels.lora_gemm import block_n_for, device_tiles, platform_reason
from kernels.lora_shrink import lora_shrink
from kernels.lora_bodies import gemv_expand, gemv_shrink
from kernels.segment_tile import segment_row, segment_tile
from kernels.platform import pdl_available
from kernels.segments import LoRASegments, check_tile



@triton.jit
def _fused_program(seg_len_ptr, seg_slot_ptr, rank_ptr, OUT, o1, o2, cols_per_prog):
    """The fused kernel's program -> (segment, position, slot, rank, slice i, columns c_lo:c_hi of it);
    c_lo >= c_hi when the program's column range lies past a narrower slice's end."""
    seg, m0, seg_len, slot, rank = segment_tile(tl.program_id(0), 1, seg_len_ptr, seg_slot_ptr, rank_ptr, 1)
    i = tl.program_id(1)  # slice
    lo = tl.where(i == 0, 0, tl.where(i == 1, o1, o2))
    hi = tl.where(i == 0, o1, tl.where(i == 1, o2, OUT))
    c_lo = lo + tl.program_id(2) * cols_per_prog
    return seg, m0, slot, rank, i, c_lo, tl.minimum(c_lo + cols_per_prog, hi)


@triton.jit
def _lora_fused_gemv_kernel(
    y_ptr,  # [T, OUT] base output, updated in place
    x_ptr,  # [T, K] input rows
    a_ptr,  # [S, N, K] A of every slot, N = n*R: row i*R + j = rank row j of slice i
    b_ptr,  # [S, OUT, R] B of every slot
    scale_ptr,  # [S] fp32 scale per slot (HAS_SCALE only)
    tok_ptr,  # [P] int32 token row per position (GATHER only)
    seg_start_ptr,  # [G] int32 position of each (one-token) segment
    seg_len_ptr,  # [G] int32 (all 1)
    seg_slot_ptr,  # [G] int32
    rank_ptr,  # [S] int32 true rank per slot
    K, OUT, R, o1, o2,  # in features, out features, max rank, first column of slices 1 and 2
    cols_per_prog,  # columns of one program along grid axis 2 (a multiple of BLOCK_N)
    stride_xt, stride_xk, stride_as, stride_an, stride_ak,
    stride_yt, stride_yo, stride_bs, stride_bo, stride_br,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, R8: tl.constexpr,
):
    seg, m0, slot, rank, i, c_lo, c_hi = _fused_program(seg_len_ptr, seg_slot_ptr, rank_ptr, OUT, o1, o2,
                                                       cols_per_prog)
    if (c_lo >= c_hi) | (rank == 0):
        return  # a slice narrower than the widest one, or an empty slot: nothing to add
    row = segment_row(seg_start_ptr, tok_ptr, seg, m0, GATHER)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    # shrink: h_i[j] = x[row] · A[slot, i, j], then the expand over this program's columns of slice i
    # (the GEMV loops of lora_shrink and lora_expand: kernels/lora_bodies.py)
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + (i * R + offs_r) * stride_an
    hv = gemv_shrink(x_ptr + row * stride_xt, a_rows, r_mask, 0, K, stride_xk, stride_ak, BLOCK_R, BLOCK_K)
    hv = hv.to(b_ptr.dtype.element_ty).to(tl.float32)  # rounded to the weights' dtype, as lora_expand does
    if HAS_SCALE:
        hv = hv * tl.load(scale_ptr + slot)
    gemv_expand(y_ptr + row * stride_yt, b_ptr + slot.to(tl.int64) * stride_bs, hv, offs_r, rank, c_lo, c_hi,
                stride_yo, stride_bo, stride_br, BLOCK_N, False, R8)


@triton.jit
def _lora_fused_tma_kernel(
    x_desc,  # TMA descriptor of x [T, K], blocks [1, BLOCK_K]
    a_desc,  # TMA descriptor of A as [S*n*R, K], blocks [BLOCK_R, BLOCK_K] (BLOCK_R = R)
    b_desc,  # TMA descriptor of B as [S*OUT, R], blocks [BLOCK_N, BLOCK_R]
    scale_ptr, tok_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, rank_ptr,  # as _lora_fused_gemv_kernel's
    K, OUT, R, NR, o1, o2, cols_per_prog,  # NR = n*R
    y_ptr, stride_yt,  # y [T, OUT], row-major: plain pointer loads and stores
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    """_lora_fused_gemv_kernel with weight loads through the copy engine, which the compiler pipelines
    STAGES deep. y uses plain loads and stores (a bulk store would wait on the previous one each step).
    Rank padding is masked in registers; column tiles never cross a slice boundary."""
    seg, m0, slot, rank, i, c_lo, c_hi = _fused_program(seg_len_ptr, seg_slot_ptr, rank_ptr, OUT, o1, o2,
                                                       cols_per_prog)
    if (c_lo >= c_hi) | (rank == 0):
        return  # a slice narrower than the widest one, or an empty slot: nothing to add
    row = segment_row(seg_start_ptr, tok_ptr, seg, m0, GATHER).to(tl.int32)
    r_mask = tl.arange(0, BLOCK_R) < rank
    acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)  # summed over K once, after the loop
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        xt = x_desc.load([row, k * BLOCK_K])  # [1, BLOCK_K]; past K zero-filled
        at = a_desc.load([slot * NR + i * R, k * BLOCK_K])  # [BLOCK_R, BLOCK_K]
        acc2 += at.to(tl.float32) * xt.to(tl.float32)
    hv = tl.where(r_mask, tl.sum(acc2, axis=1), 0.0)
    y_ty = y_ptr.dtype.element_ty
    hv = hv.to(y_ty).to(tl.float32)  # rounded to the weights' dtype, as lora_expand does
    if HAS_SCALE:
        hv = hv * tl.load(scale_ptr + slot)
    y_row = y_ptr + row.to(tl.int64) * stride_yt
    for c0 in tl.range(c_lo, c_hi, BLOCK_N, num_stages=STAGES):
        bt = b_desc.load([slot * OUT + c0, 0])  # [BLOCK_N, BLOCK_R]
        cols = c0 + tl.arange(0, BLOCK_N)[None, :]
        yt = tl.load(y_row + cols, mask=cols < c_hi, other=0.0)  # before the reduction that waits on B
        bt = tl.where(r_mask[None, :], bt.to(tl.float32), 0.0)  # rank padding may hold anything
        acc = tl.sum(bt * hv[None, :], axis=1)
        out = (yt.to(tl.float32) + acc[None, :]).to(y_ty)
        tl.store(y_row + cols, out, mask=cols < c_hi)


def tma_unfit_reason(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     out_offsets: Sequence[int]) -> Optional[str]:
    """None when the fused kernel's TMA body takes these operands, else why not: platform_reason
    (sm90+, bf16/fp16), contiguous A and B with a power-of-two max rank, 16-byte-aligned rows, and a
    column tile >= 16 dividing every slice boundary."""
    reason = platform_reason(x.device, x.dtype)
    if reason is not None:
        return reason
    R = B.shape[-1]
    if not (A.is_contiguous() and B.is_contiguous()):
        return "A and B must be contiguous"
    if R & (R - 1) or (R * B.element_size()) % 16:
        return f"the max rank {R} must be a power of two whose B row is a multiple of 16 bytes"
    for name, t in (("x", x), ("y", y), ("A", A.view(-1, A.shape[-1])), ("B", B.view(-1, R))):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name} must be row-major with rows on 16-byte boundaries"
    if block_n_for(out_offsets, 16) == 0:
        return f"no column tile >= 16 divides the slice boundaries {list(out_offsets)}"
    return None


def lora_apply(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
               slot_ranks: torch.Tensor, out_offsets: Sequence[int], scalings: Optional[torch.Tensor] = None, *,
               fused: Optional[bool] = None, split_k: Optional[int] = None, block_k: Optional[int] = None,
               block_n: Optional[int] = None, cols_per_prog: Optional[int] = None, num_warps: Optional[int] = None,
               num_stages: Optional[int] = None, pdl: Optional[bool] = None,
               tma: Optional[bool] = None) -> torch.Tensor:
    """y[t, o_i:o_{i+1}] += scale[slot(t)] * (x[t] @ A[slot(t), i, :r]ᵀ) @ B[slot(t), o_i:o_{i+1}, :r]ᵀ, in place.

    x [T, in], A [S, n, R, in], y [T, out], B [S, out, R], one dtype; segs, slot_ranks, out_offsets,
    scalings as for lora_shrink / lora_expand. Returns y. fused: one launch (None = when every segment
    is one token; whether it pays is appliance/lora/backend/policy.py's choice). split_k, block_*,
    cols_per_prog, num_warps, num_stages: tile overrides. pdl (unfused) and tma (fused): None = where
    the device supports it; True forces the same bodies, which is how the CPU tests reach them.
    """
    if fused is None:
        fused = segs.max_len == 1
    if not fused:
        if pdl is None:
            pdl = pdl_available(x.device)
        h = lora_shrink(x, A, segs, slot_ranks, split_k=split_k, partials=segs.max_len == 1,
                        launch_dependents=pdl)
        return lora_expand(y, h, B, segs, slot_ranks, out_offsets, scalings, pdl=pdl,
                           block_n=block_n if pdl else None)
    if segs.max_len > 1:
        raise ValueError(f"lora_apply: the fused kernel takes one-token segments, the longest is {segs.max_len}")
    if x.dim() != 2 or A.dim() != 4 or y.dim() != 2 or B.dim() != 3:
        raise ValueError(f"lora_apply: x must be [T, in], A [S, n, R, in], y [T, out], B [S, out, R]; got "
                         f"{tuple(x.shape)}, {tuple(A.shape)}, {tuple(y.shape)}, {tuple(B.shape)}")
    T, K = x.shape
    S, n, R, K_a = A.shape
    OUT = y.shape[1]
    if K_a != K or y.shape[0] != T or B.shape != (S, OUT, R):
        raise ValueError(f"lora_apply: shapes disagree: x {tuple(x.shape)}, A {tuple(A.shape)}, "
                         f"y {tuple(y.shape)}, B {tuple(B.shape)}")
    if not (x.dtype == A.dtype == y.dtype == B.dtype) or x.dtype not in (torch.float32, torch.bfloat16,
                                                                         torch.float16):
        raise ValueError(f"lora_apply: x, A, y and B must share one of fp32/bf16/fp16, got "
                         f"{x.dtype}, {A.dtype}, {y.dtype}, {B.dtype}")
    if not A.is_contiguous():
        raise ValueError("lora_apply: A must be contiguous (its [n, R] dims are read as one)")
    offs = check_out_slices("lora_apply", y, out_offsets, n, R, segs, slot_ranks, S, scalings)
    reason = None if tma is False else tma_unfit_reason(y, x, A, B, offs)  # host-side checks, per call
    if tma and reason is not None:
        raise ValueError(f"lora_apply: the TMA body does not take these operands: {reason}")
    if tma is None:
        tma = reason is None and y.device.type == "cuda"
    G = segs.num_segs
    if G == 0 or T == 0:
        return y
    widest = max(b - a for a, b in zip(offs, offs[1:]))
    if tma:
        return _launch_tma(y, x, A, B, segs, slot_ranks, offs, scalings, widest, block_k, block_n, cols_per_prog,
                           num_warps, num_stages)
    block_r = max(16, triton.next_power_of_2(R))
    if block_k is None:
        block_k = max(16, 8192 // block_r)  # [BLOCK_R, BLOCK_K] fp32 partial sums: 64 per thread
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    if block_n is None:
        block_n = 256
    block_n = min(block_n, max(16, triton.next_power_of_2(widest)))
    check_tile(block_k=block_k, block_n=block_n)
    if cols_per_prog is None:
        cols_per_prog = _auto_cols_per_prog(G * n, widest, block_n, y.device)
    if cols_per_prog % block_n:
        raise ValueError(f"lora_apply: cols_per_prog {cols_per_prog} must be a multiple of block_n {block_n}")
    a3 = A.view(S, n * R, K)
    o1 = offs[1] if n > 1 else OUT
    o2 = offs[2] if n > 2 else OUT
    tok = segs.token_index if segs.token_index is not None else segs.starts
    grid = (G, n, triton.cdiv(widest, cols_per_prog))
    _lora_fused_gemv_kernel[grid](
        y, x, a3, B, scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.lens, segs.slots,
        slot_ranks,
        K, OUT, R, o1, o2, cols_per_prog,
        x.stride(0), x.stride(1), a3.stride(0), a3.stride(1), a3.stride(2),
        y.stride(0), y.stride(1), B.stride(0), B.stride(1), B.stride(2),
        BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
        GATHER=segs.token_index is not None, HAS_SCALE=scalings is not None, R8=R % 8 == 0,
        num_warps=num_warps or 4, num_stages=num_stages or 3,
    )
    return y


def _launch_tma(y, x, A, B, segs, slot_ranks, offs, scalings, widest, block_k, block_n, cols_per_prog, num_warps,
                num_stages) -> torch.Tensor:
    """lora_apply's fused kernel, TMA body (operands checked by lora_apply and tma_unfit_reason)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, K = x.shape
    S, n, R, _ = A.shape
    OUT = y.shape[1]
    d = device_tiles(x.device).apply_tma
    d_bk, d_bn, d_st, d_w = d.block_k, d.block_n, d.num_stages, d.num_warps
    # a copy-engine box is at most 256 elements a side; BLOCK_N must divide every slice boundary
    block_k = min(block_k or d_bk, 256, max(16, triton.next_power_of_2(K)))
    block_n = block_n_for(offs, min(block_n or d_bn, 256, max(16, triton.next_power_of_2(widest))))
    check_tile(block_k=block_k, block_n=block_n)
    # Whole slices per program (TMA body): column splits would stream A again.
    if cols_per_prog is None:
        cols_per_prog = triton.cdiv(widest, block_n) * block_n
    if cols_per_prog % block_n:
        raise ValueError(f"lora_apply: cols_per_prog {cols_per_prog} must be a multiple of block_n {block_n}")
    tok = segs.token_index if segs.token_index is not None else segs.starts
    grid = (segs.num_segs, n, triton.cdiv(widest, cols_per_prog))
    _lora_fused_tma_kernel[grid](
        TensorDescriptor.from_tensor(x, [1, block_k]),
        TensorDescriptor.from_tensor(A.view(S * n * R, K), [R, block_k]),
        TensorDescriptor.from_tensor(B.view(S * OUT, R), [block_n, R]),
        scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.lens, segs.slots, slot_ranks,
        K, OUT, R, n * R, offs[1] if n > 1 else OUT, offs[2] if n > 2 else OUT, cols_per_prog, y, y.stride(0),
        BLOCK_R=R, BLOCK_K=block_k, BLOCK_N=block_n, STAGES=num_stages or d_st,
        GATHER=segs.token_index is not None, HAS_SCALE=scalings is not None, num_warps=num_warps or d_w,
    )
    return y


def _auto_cols_per_prog(programs: int, widest: int, block_n: int, device: torch.device) -> int:
    """The pointer body's column splits: a whole slice per program when (token, slice) pairs fill the
    SMs twice over; else split the columns (each split recomputes h from A, mostly out of L2) until
    they do. (The TMA body always takes whole slices: _launch_tma.)"""
    n_steps = triton.cdiv(widest, block_n)
    if device.type != "cuda":
        return n_steps * block_n
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(n_steps, triton.cdiv(2 * sms, programs)))
    return triton.cdiv(n_steps, splits) * block_n
