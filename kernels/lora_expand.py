"""lora_expand: the second half of a multi-LoRA projection, fused with the add into the base output.

    y[t, o_i + c] += scale[slot(t)] * sum_{j < rank[slot(t)]} h[t, i*R + j] * B[slot(t), o_i + c, j]

for every slice i (columns o_i:o_{i+1}) and adapter token t, in place, one launch. A program owns
BLOCK_M rows of one segment and a column range, walked slice by slice with h in registers so the B/y
loop pipelines; rank padding and base tokens' rows are never touched. BLOCK_M = 1 is a GEMV body
(kernels/lora_bodies.py), BLOCK_M >= 16 uses tl.dot.

pdl=True launches it as a programmatic dependent of lora_shrink: it reads only B, the segment
metadata and the scalings before `griddepcontrol.wait`, so the kernel before must not write those.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_wait, pdl_launch
from kernels.lora_bodies import gemv_expand, plane_sum, rank_tile
from kernels.lora_shrink import MAX_PLANES
from kernels.platform import dot_upcast, pdl_available
from kernels.segment_tile import segment_row, segment_rows, segment_tile
from kernels.segments import LoRASegments, check_segments, check_tile


# These vary every step: specialising on them (== 1, divisible by 16) or unrolling over them would
# compile new variants while serving (a request would pay each compile).
@triton.jit(do_not_specialize=["tiles_per_seg", "num_base", "stride_hp", "n_parts"])
def _lora_expand_kernel(
    y_ptr,  # [T, OUT] base output, updated in place (WRITE: overwritten)
    h_ptr,  # [P, T, n*R] fp32 from lora_shrink: P planes of partial sums (P = n_parts), summed here
    b_ptr,  # [S, OUT, R] B of every slot
    scale_ptr,  # [S] fp32 scale per slot (HAS_SCALE only)
    tok_ptr,  # [P] int32 token row per position (GATHER only)
    seg_start_ptr,  # [G] int32
    seg_len_ptr,  # [G] int32
    seg_slot_ptr,  # [G] int32
    rank_ptr,  # [S] int32 true rank per slot
    base_ptr,  # [num_base] int32 rows of base tokens (WRITE only: zeroed, ZERO_M rows a program)
    OUT, R, o1, o2,  # output width, max rank, first column of slices 1 and 2 (= OUT when absent)
    cols_per_prog,  # output columns of one program along grid axis 1
    stride_yt, stride_yo, stride_ht, stride_hn, stride_hp, stride_bs, stride_bo, stride_br,
    tiles_per_seg, num_base,
    n_parts,  # P: a loop bound, not a constexpr (the shrink's auto K split takes any count up to 16)
    N_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, ZERO_M: tl.constexpr, GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
    WRITE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, R8: tl.constexpr,
    PLANES_UNROLL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (PDL): everything below waits for the shrink's h to be complete
    pid = tl.program_id(0)
    p_lo = tl.program_id(1) * cols_per_prog
    p_hi = tl.minimum(p_lo + cols_per_prog, OUT)
    if WRITE:
        n_seg_progs = tl.num_programs(0) - tl.cdiv(num_base, ZERO_M)
        if pid >= n_seg_progs:
            # The last cdiv(num_base, ZERO_M) programs zero the base tokens' rows, so the base GEMM
            # can accumulate into all of y (no separate memset of the whole output).
            offs_b = (pid - n_seg_progs) * ZERO_M + tl.arange(0, ZERO_M)
            b_mask = offs_b < num_base
            b_rows = tl.load(base_ptr + offs_b, mask=b_mask, other=0).to(tl.int64)
            zeros = tl.zeros((ZERO_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
            for c0 in range(p_lo, p_hi, BLOCK_N):
                offs_c = c0 + tl.arange(0, BLOCK_N)
                tl.store(y_ptr + b_rows[:, None] * stride_yt + offs_c[None, :] * stride_yo, zeros,
                         mask=b_mask[:, None] & (offs_c < p_hi)[None, :])
            return
    seg, m0, seg_len, slot, rank = segment_tile(pid, tiles_per_seg, seg_len_ptr, seg_slot_ptr, rank_ptr, BLOCK_M)
    if m0 >= seg_len:
        return
    if not WRITE:
        if rank == 0:
            return  # empty slot: nothing to add (WRITE goes on: its rows must become 0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    b_ty = b_ptr.dtype.element_ty
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + tl.maximum(slot, 0))  # slot -1 (padding) has rank 0: any scale
    if BLOCK_M == 1:
        row = segment_row(seg_start_ptr, tok_ptr, seg, m0, GATHER)
    else:
        rows, m_mask = segment_rows(seg_start_ptr, tok_ptr, seg, m0, seg_len, BLOCK_M, GATHER)
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
        c_lo = tl.maximum(lo, p_lo)
        c_hi = tl.minimum(hi, p_hi)  # c_lo >= c_hi: this program holds no column of slice i
        if BLOCK_M == 1:
            h_ptrs1 = h_ptr + row * stride_ht + (i * R + offs_r) * stride_hn
            hv = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for p in range(n_parts):  # K splits' partial sums, added in a fixed order
                hv += tl.load(h_ptrs1 + p * stride_hp, mask=r_mask, other=0.0)
            hv = hv.to(b_ty).to(tl.float32) * scale  # h rounded to the weights' dtype, as the torch twin does
            gemv_expand(y_ptr + row * stride_yt, b_base, hv, offs_r, rank, c_lo, c_hi, stride_yo, stride_bo,
                        stride_br, BLOCK_N, WRITE, R8)
        else:
            h_ptrs = h_ptr + rows[:, None] * stride_ht + (i * R + offs_r)[None, :] * stride_hn
            ht = plane_sum(h_ptrs, m_mask, offs_r, rank, n_parts, stride_hp, BLOCK_M, BLOCK_R, R8, PLANES_UNROLL)
            ht = ht.to(b_ty)  # h rounded to the weights' dtype, as the torch twin does
            if UPCAST:
                ht = ht.to(tl.float32)
            for c0 in range(c_lo, c_hi, BLOCK_N):
                offs_c = c0 + tl.arange(0, BLOCK_N)
                c_mask = offs_c < c_hi
                # B [BLOCK_N, R] in its own layout (R contiguous: wide loads), transposed in registers
                bt = tl.trans(rank_tile(b_base + offs_c[:, None] * stride_bo + offs_r[None, :] * stride_br, c_mask,
                                        offs_r, rank, R8, ""))  # [BLOCK_R, BLOCK_N]
                y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_c[None, :] * stride_yo
                y_mask = m_mask[:, None] & c_mask[None, :]
                if UPCAST:
                    bt = bt.to(tl.float32)
                acc = tl.dot(ht, bt, input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N] fp32
                if WRITE:
                    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
                else:
                    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
                    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=y_mask)


@triton.jit(do_not_specialize=["stride_hp"])
def _lora_expand_gemv_kernel(
    y_ptr,  # [T, OUT] base output, updated in place
    h_ptr,  # [P, T, n*R] fp32 planes of partial sums from lora_shrink, summed here
    b_ptr,  # [S, OUT, R] B of every slot
    scale_ptr,  # [S] fp32 scale per slot (HAS_SCALE only)
    tok_ptr,  # [P] int32 token row per position (GATHER only)
    seg_start_ptr,  # [G] int32 position of each (one-token) segment
    seg_len_ptr,  # [G] int32 (all 1)
    seg_slot_ptr,  # [G] int32
    rank_ptr,  # [S] int32 true rank per slot
    OUT, R, o1, o2,  # output width, max rank, first column of slices 1 and 2 (= OUT when absent)
    stride_yt, stride_yo, stride_ht, stride_hn, stride_hp, stride_bs, stride_bo, stride_br,
    N_SLICES: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, PDL: tl.constexpr, R8: tl.constexpr,
):
    """One token, one BLOCK_N block of output columns (any slices it spans): B tile first, then the wait."""
    seg, m0, seg_len, slot, rank = segment_tile(tl.program_id(0), 1, seg_len_ptr, seg_slot_ptr, rank_ptr, 1)
    offs_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = offs_c < OUT
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank  # rank 0 (empty slot, padding row): nothing loaded
    row = segment_row(seg_start_ptr, tok_ptr, seg, m0, GATHER)
    # B [BLOCK_N, R] in its own layout (R contiguous: one contiguous run of BLOCK_N * R elements)
    bt = rank_tile(b_ptr + slot.to(tl.int64) * stride_bs + offs_c[:, None] * stride_bo + offs_r[None, :] * stride_br,
                   c_mask, offs_r, rank, R8, "")
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + tl.maximum(slot, 0))
    if PDL:
        gdc_wait()  # h (and y) are the shrink's and earlier kernels' output: only from here on
    if rank == 0:
        return
    # each column's slice: h of that slice, rounded to the weights' dtype as the torch twin does
    sl = (offs_c >= o1).to(tl.int32) + (offs_c >= o2).to(tl.int32)
    h_row = h_ptr + row * stride_ht
    hsel = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for i in tl.static_range(N_SLICES):
        hv = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for p in tl.static_range(N_PARTS):  # K splits' partial sums, added in a fixed order
            hv += tl.load(h_row + p * stride_hp + (i * R + offs_r) * stride_hn, mask=r_mask, other=0.0)
        hv = hv.to(b_ptr.dtype.element_ty).to(tl.float32) * scale
        hsel = tl.where((sl == i)[:, None], hv[None, :], hsel)
    y_ptrs = y_ptr + row * stride_yt + offs_c * stride_yo
    yv = tl.load(y_ptrs, mask=c_mask, other=0.0)
    acc = tl.sum(bt.to(tl.float32) * hsel, axis=1)  # [BLOCK_N] fp32
    tl.store(y_ptrs, (yv.to(tl.float32) + acc).to(yv.dtype), mask=c_mask)


def lora_expand(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, segs: LoRASegments, slot_ranks: torch.Tensor,
                out_offsets: Sequence[int], scalings: Optional[torch.Tensor] = None, *, write: bool = False,
                block_m: Optional[int] = None, block_n: Optional[int] = None,
                num_warps: Optional[int] = None, cols_per_prog: Optional[int] = None,
                num_stages: Optional[int] = None, pdl: bool = False,
                unroll: Optional[int] = None) -> torch.Tensor:
    """y[t, o_i:o_{i+1}] += scale[slot(t)] * h[t, i, :r] @ B[slot(t), o_i:o_{i+1}, :r]ᵀ, every slice i, in place.

    y [T, out] (unit column stride); h [T, n, R] fp32, or [P, T, n, R] planes summed here; B [S, out, R]
    in y's dtype; slot_ranks [S] int32; out_offsets [n + 1] host ints, n <= 3; scalings [S] fp32 or
    None (the engine folds alpha/r into B, since it is per module). Returns y.
    write=False leaves rows outside every segment as they were; write=True never reads y: adapter rows
    get the delta, segs.base_rows get 0, and every row must be one or the other (kernels/lora_linear.py).
    block_m, block_n, num_warps, cols_per_prog, num_stages, unroll: tile overrides (None = launcher's).
    pdl: see the module docstring; the kernel before must not write B, segs or scalings.
    """
    if y.dim() != 2 or h.dim() not in (3, 4) or B.dim() != 3:
        raise ValueError(f"lora_expand: y must be [T, out], h [T, n, R] or [P, T, n, R], B [S, out, R]; got "
                         f"{tuple(y.shape)}, {tuple(h.shape)}, {tuple(B.shape)}")
    T, OUT = y.shape
    S, OUT_b, R = B.shape
    h4 = h if h.dim() == 4 else h.unsqueeze(0)
    P, n = h4.shape[0], h4.shape[2]
    if h4.shape != (P, T, n, R) or OUT_b != OUT or P < 1:
        raise ValueError(f"lora_expand: shapes disagree: y {tuple(y.shape)}, h {tuple(h.shape)}, B {tuple(B.shape)}")
    if h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError(f"lora_expand: h must be contiguous fp32 (lora_shrink's output), got {h.dtype}")
    if y.dtype != B.dtype or y.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"lora_expand: y and B must share one of fp32/bf16/fp16, got {y.dtype}, {B.dtype}")
    offs = check_out_slices("lora_expand", y, out_offsets, n, R, segs, slot_ranks, S, scalings)
    num_base = 0
    if write:
        if segs.base_rows is None:
            raise ValueError("lora_expand: write=True needs segs.base_rows (the builders in kernels/segments.py set it)")
        num_base = segs.base_rows.shape[0]
        if segs.num_rows + num_base != T:
            raise ValueError(f"lora_expand: write=True must cover every row of y: {segs.num_rows} adapter + "
                             f"{num_base} base rows != {T}")
    G = segs.num_segs
    if (G == 0 and num_base == 0) or T == 0:
        return y
    if block_m is None:
        # One-token segments: the GEMV body. Else tensor-core tiles as tall as the segments allow.
        block_m = 1 if segs.max_len == 1 else (16 if segs.max_len <= 16 else (32 if segs.max_len <= 32 else 64))
    if unroll and unroll < P:
        raise ValueError(f"lora_expand: unroll {unroll} must cover the {P} planes of h (or be 0: a loop)")
    launch_pdl = pdl and pdl_available(y.device)
    if pdl and OUT <= B_FIRST_MAX_OUT and block_m == 1 and not write:
        return _expand_gemv_pdl(y, h4, B, segs, slot_ranks, offs, scalings, block_n, num_warps, num_stages,
                                launch_pdl)
    if block_n is None:
        block_n = 256 if block_m == 1 else 128
    block_n = min(block_n, max(16, triton.next_power_of_2(OUT)))
    if block_m != 1:
        check_tile(block_m=block_m)
    check_tile(block_n=block_n)
    block_r = max(16, triton.next_power_of_2(R))
    tiles_per_seg = triton.cdiv(segs.max_len, block_m) if G else 0
    zero_m = max(16, block_m)  # rows per base-zeroing program (WRITE)
    programs_m = G * tiles_per_seg + triton.cdiv(num_base, zero_m)
    if cols_per_prog is None:
        cols_per_prog = _auto_cols_per_prog(programs_m, OUT, block_n, block_m, y.device)
    if cols_per_prog % block_n:
        raise ValueError(f"lora_expand: cols_per_prog {cols_per_prog} must be a multiple of block_n {block_n}")
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 3
    o1 = offs[1] if n > 1 else OUT
    o2 = offs[2] if n > 2 else OUT
    tok = segs.token_index if segs.token_index is not None else segs.starts
    base = segs.base_rows if num_base else slot_ranks  # a valid int32 pointer; not read when num_base = 0
    grid = (programs_m, triton.cdiv(OUT, cols_per_prog))
    _lora_expand_kernel[grid](
        y, h4, B, scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.lens, segs.slots,
        slot_ranks, base,
        OUT, R, o1, o2, cols_per_prog,
        y.stride(0), y.stride(1), h4.stride(1), h4.stride(3), h4.stride(0), B.stride(0), B.stride(1), B.stride(2),
        max(tiles_per_seg, 1), num_base, P,
        N_SLICES=n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, ZERO_M=zero_m,
        GATHER=segs.token_index is not None, HAS_SCALE=scalings is not None, WRITE=write,
        PRECISION="ieee" if y.dtype == torch.float32 else "tf32", UPCAST=dot_upcast(y.dtype), R8=R % 8 == 0,
        PLANES_UNROLL=planes_unroll(P, block_m) if unroll is None else unroll,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(launch_pdl),
    )
    return y


def planes_unroll(n_parts: int, block_m: int) -> int:
    """plane_sum's UNROLL for a tile body: unrolled for 16-row tiles (the decode graphs' sorted chunks),
    a loop otherwise; one value per row-tile class so the plane count never compiles a new variant."""
    return MAX_PLANES if (n_parts <= MAX_PLANES and 1 < block_m <= 16) else 0


# Wider outputs use the column loop after the wait: one-block programs would each pay the wait and a launch.
B_FIRST_MAX_OUT = 16384

# Columns per program of the PDL GEMV body; its whole B tile is held in registers across the wait.
PDL_BLOCK_N = 512


def _expand_gemv_pdl(y: torch.Tensor, h4: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
                     slot_ranks: torch.Tensor, offs: list[int], scalings: Optional[torch.Tensor],
                     block_n: Optional[int], num_warps: Optional[int], num_stages: Optional[int],
                     launch_pdl: bool) -> torch.Tensor:
    """lora_expand's one-token, add-mode path under pdl=True (checks done by the caller)."""
    G = segs.num_segs
    if G == 0:
        return y
    T, OUT = y.shape
    n, R = h4.shape[2], B.shape[2]
    block_n = min(block_n or PDL_BLOCK_N, max(16, triton.next_power_of_2(OUT)))
    check_tile(block_n=block_n)
    o1 = offs[1] if n > 1 else OUT
    o2 = offs[2] if n > 2 else OUT
    tok = segs.token_index if segs.token_index is not None else segs.starts
    grid = (G, triton.cdiv(OUT, block_n))
    _lora_expand_gemv_kernel[grid](
        y, h4, B, scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.lens, segs.slots,
        slot_ranks, OUT, R, o1, o2,
        y.stride(0), y.stride(1), h4.stride(1), h4.stride(3), h4.stride(0), B.stride(0), B.stride(1), B.stride(2),
        N_SLICES=n, N_PARTS=h4.shape[0], BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(R)),
        GATHER=segs.token_index is not None, HAS_SCALE=scalings is not None, R8=R % 8 == 0,
        num_warps=num_warps or 4, num_stages=num_stages or 1, **pdl_launch(launch_pdl),
    )
    return y


def _auto_cols_per_prog(programs_m: int, OUT: int, block_n: int, block_m: int, device: torch.device) -> int:
    """Columns per program: long enough loops to pipeline, yet enough programs to fill the SMs:
    >= ~8 per SM for GEMV tiles (BLOCK_N x R weights each), >= ~4 per SM for tensor-core tiles."""
    n_steps = triton.cdiv(OUT, block_n)
    if device.type != "cuda":
        return n_steps * block_n  # interpreter: fewest programs (each costs host time)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if block_m == 1:
        # tuned: a few column steps a program beat one or two
        splits = max(triton.cdiv(n_steps, 4), triton.cdiv(8 * sms, programs_m))
    else:
        splits = triton.cdiv(4 * sms, programs_m)
    splits = max(1, min(n_steps, splits))
    return triton.cdiv(n_steps, splits) * block_n


def check_out_slices(op: str, y: torch.Tensor, out_offsets: Sequence[int], n: int, R: int,
                     segs: Optional[LoRASegments], slot_ranks: torch.Tensor, num_slots: int,
                     scalings: Optional[torch.Tensor]) -> list[int]:
    """The checks of the expand side that lora_expand, lora_apply's fused kernel, silu_mul_lora and
    lora_gemm share: y's layout, the n output slices (returned as a list), the rank bound, the segment
    metadata (segs None: the caller checks the row metadata it takes instead) and the scalings."""
    OUT = y.shape[1]
    if y.stride(1) != 1:
        raise ValueError(f"{op}: y's columns must be contiguous")
    offs = list(out_offsets)
    if len(offs) != n + 1 or offs[0] != 0 or offs[-1] != OUT or any(a >= b for a, b in zip(offs, offs[1:])):
        raise ValueError(f"{op}: out_offsets {offs} must rise from 0 to {OUT} in {n} slices")
    if not 1 <= n <= 3:
        raise ValueError(f"{op}: 1 to 3 slices supported, got {n}")
    if R > 64:
        raise ValueError(f"{op}: max rank {R} > 64 (the whole rank is one register tile)")
    if segs is not None:
        check_segments(segs, slot_ranks, num_slots, y.device)
    if scalings is not None and (scalings.shape != (num_slots,) or scalings.dtype != torch.float32
                                 or scalings.device != y.device):
        raise ValueError(f"{op}: scalings must be fp32 [{num_slots}] on {y.device}")
    return offs
