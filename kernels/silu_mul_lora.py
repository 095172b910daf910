"""silu_mul_lora: gate_up_proj's LoRA expand fused into the MLP's activation (decode and prefill).

    g = gate_up[t, j]     + scale[s] * h[t, 0, :r] · B[s, j, :r]          s = slot(t), r = rank[s]
    u = gate_up[t, I + j] + scale[s] * h[t, 1, :r] · B[s, I + j, :r]      (no delta for base rows)
    out[t, j] = silu(g) * u

lora_expand (add mode) into gate_up then silu_mul, with the same roundings, in one launch: the expand's
read-modify-write of the [T, 2I] gate_up output goes, and gate_up's B streams in the activation's pass.
One-token segments (decode) use a GEMV body that, with PDL, loads B before waiting on the base GEMM
(no kernel of the step writes adapter weights); multi-token segments use lora_expand's tile body.
Every row of gate_up must be in a segment or a listed base row. h: lora_shrink's partials planes [P, T, 2, R].
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_wait, pdl_launch
from kernels.lora_bodies import plane_sum, rank_tile
from kernels.lora_expand import check_out_slices, planes_unroll
from kernels.platform import dot_upcast, pdl_available
from kernels.segment_tile import segment_row, segment_rows, segment_tile
from kernels.segments import LoRASegments, check_tile, rows_covered


@triton.jit(do_not_specialize=["n_parts", "stride_hp", "num_segs"])
def _silu_mul_lora_kernel(
    x_ptr,  # [T, 2I] gate | up, the base GEMM's output (read only)
    out_ptr,  # [T, I]
    h_ptr,  # [P, T, 2*R] fp32 planes of partial sums from lora_shrink
    b_ptr,  # [S, 2I, R] B of every slot
    scale_ptr,  # [S] fp32 (HAS_SCALE only)
    tok_ptr,  # [P] int32 token row per position (GATHER only)
    seg_start_ptr,  # [G] int32
    seg_slot_ptr,  # [G] int32 (-1: no adapter)
    rank_ptr,  # [S] int32
    base_ptr,  # [Tb] int32 rows of base tokens (programs G..)
    I, R, num_segs, n_parts,
    stride_x, stride_o, stride_ht, stride_hn, stride_hp, stride_bs, stride_bo, stride_br,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
    PDL: tl.constexpr, R8: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    offs_r = tl.arange(0, BLOCK_R)
    # branch-free prologue: programs past the segments take a base row (slot -1, rank 0)
    is_seg = pid < num_segs
    seg = tl.minimum(pid, num_segs - 1)  # the launcher guarantees num_segs >= 1
    slot = tl.load(seg_slot_ptr + seg, mask=is_seg, other=-1)
    rank = tl.where(slot < 0, 0, tl.load(rank_ptr + tl.maximum(slot, 0)))
    base_row = tl.load(base_ptr + tl.maximum(pid - num_segs, 0), mask=pid >= num_segs, other=0).to(tl.int64)
    row = tl.where(is_seg, segment_row(seg_start_ptr, tok_ptr, seg, 0, GATHER), base_row)
    r_mask = offs_r < rank  # rank 0 (base row, empty slot): nothing loaded, no delta
    b_rows = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + offs_r[None, :] * stride_br
    bg = rank_tile(b_rows + offs[:, None] * stride_bo, mask, offs_r, rank, R8, "")  # [BLOCK, BLOCK_R]
    bu = rank_tile(b_rows + (I + offs)[:, None] * stride_bo, mask, offs_r, rank, R8, "")
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + tl.maximum(slot, 0))
    if PDL:
        gdc_wait()  # gate_up is the GEMM's output: only from here on
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + offs, mask=mask, other=0.0)
    u = tl.load(x_row + I + offs, mask=mask, other=0.0)
    if rank > 0:
        h_row = h_ptr + row * stride_ht
        hg = tl.zeros((BLOCK_R,), dtype=tl.float32)
        hu = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for p in range(n_parts):  # the shrink's K splits, added in a fixed order (as lora_expand)
            hg += tl.load(h_row + p * stride_hp + offs_r * stride_hn, mask=r_mask, other=0.0)
            hu += tl.load(h_row + p * stride_hp + (R + offs_r) * stride_hn, mask=r_mask, other=0.0)
        b_ty = b_ptr.dtype.element_ty
        hg = hg.to(b_ty).to(tl.float32) * scale  # rounded to the weights' dtype, as lora_expand does
        hu = hu.to(b_ty).to(tl.float32) * scale
        g = (g.to(tl.float32) + tl.sum(bg.to(tl.float32) * hg[None, :], axis=1)).to(g.dtype)
        u = (u.to(tl.float32) + tl.sum(bu.to(tl.float32) * hu[None, :], axis=1)).to(u.dtype)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(out_ptr.dtype.element_ty)  # silu_mul's fp32 math, rounded
    tl.store(out_ptr + row * stride_o + offs, (act.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["n_parts", "stride_hp", "num_segs", "tiles_per_seg", "num_base"])
def _silu_mul_lora_tile_kernel(
    x_ptr,  # [T, 2I] gate | up, the base GEMM's output (read only)
    out_ptr,  # [T, I]
    h_ptr,  # [P, T, 2*R] fp32 planes of partial sums from lora_shrink
    b_ptr,  # [S, 2I, R] B of every slot
    scale_ptr,  # [S] fp32 (HAS_SCALE only)
    tok_ptr,  # [P] int32 token row per position (GATHER only)
    seg_start_ptr,  # [G] int32
    seg_len_ptr,  # [G] int32
    seg_slot_ptr,  # [G] int32
    rank_ptr,  # [S] int32
    base_ptr,  # [Tb] int32 rows of base tokens (the programs after the segments' tiles)
    I, R, num_segs, tiles_per_seg, num_base, n_parts, cols_per_prog,
    stride_x, stride_o, stride_ht, stride_hn, stride_hp, stride_bs, stride_bo, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr, R8: tl.constexpr, PLANES_UNROLL: tl.constexpr,
):
    """Multi-token segments (prefill): a program owns BLOCK_M rows of one segment (or of the listed base
    rows) and walks its columns of gate and up BLOCK_N at a time with lora_expand's tile body; base
    rows get rank 0, so the loop adds exactly 0 without a branch. A loop, not a program per tile, so
    the prologue's chain of dependent loads is paid once per program."""
    pid = tl.program_id(0)
    # branch-free prologue: programs past the segments' tiles take BLOCK_M base rows (rank 0)
    n_seg_tiles = num_segs * tiles_per_seg  # the launcher guarantees num_segs >= 1
    is_seg = pid < n_seg_tiles
    seg, m0, seg_len, slot, rank = segment_tile(tl.minimum(pid, n_seg_tiles - 1), tiles_per_seg, seg_len_ptr,
                                                seg_slot_ptr, rank_ptr, BLOCK_M)
    if is_seg & (m0 >= seg_len):
        return  # a tile past a shorter segment's end
    seg_rows, seg_mask = segment_rows(seg_start_ptr, tok_ptr, seg, m0, seg_len, BLOCK_M, GATHER)
    offs_b = (pid - n_seg_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    b_mask = (offs_b >= 0) & (offs_b < num_base)
    base_rows = tl.load(base_ptr + offs_b, mask=b_mask, other=0).to(tl.int64)
    rows = tl.where(is_seg, seg_rows, base_rows)
    m_mask = tl.where(is_seg, seg_mask, b_mask)
    rank = tl.where(is_seg, rank, 0)
    slot = tl.maximum(slot, 0)  # rank 0 (base rows, slot -1 padding): nothing of it is loaded
    b_ty = b_ptr.dtype.element_ty
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + slot)
    # h's and B's rank columns through kernels/lora_bodies.py's rank_tile (wide loads, 0 past the rank)
    offs_r = tl.arange(0, BLOCK_R)
    if PDL:
        gdc_wait()  # gate_up is the GEMM's output and h the shrink's: only from here on
    h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hn
    # the shrink's K splits, added in plane order (as lora_expand)
    hg = plane_sum(h_ptrs, m_mask, offs_r, rank, n_parts, stride_hp, BLOCK_M, BLOCK_R, R8, PLANES_UNROLL)
    hu = plane_sum(h_ptrs + R * stride_hn, m_mask, offs_r, rank, n_parts, stride_hp, BLOCK_M, BLOCK_R, R8,
                   PLANES_UNROLL)
    hg = hg.to(b_ty)  # rounded to the weights' dtype, as lora_expand does
    hu = hu.to(b_ty)
    if UPCAST:
        hg = hg.to(tl.float32)
        hu = hu.to(tl.float32)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[None, :] * stride_br
    x_rows = x_ptr + rows[:, None] * stride_x
    o_rows = out_ptr + rows[:, None] * stride_o
    c_lo = tl.program_id(1) * cols_per_prog
    c_hi = tl.minimum(c_lo + cols_per_prog, I)
    for c0 in tl.range(c_lo, c_hi, BLOCK_N, num_stages=STAGES):
        offs_n = c0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < c_hi
        mask = m_mask[:, None] & n_mask[None, :]
        g = tl.load(x_rows + offs_n[None, :], mask=mask, other=0.0)
        u = tl.load(x_rows + I + offs_n[None, :], mask=mask, other=0.0)
        # B [BLOCK_N, R] in its own layout (one contiguous run of BLOCK_N * R elements: wide loads),
        # transposed in registers for the dot
        bg = tl.trans(rank_tile(b_rows + offs_n[:, None] * stride_bo, n_mask, offs_r, rank, R8, ""))  # [BLOCK_R, BLOCK_N]
        bu = tl.trans(rank_tile(b_rows + (I + offs_n)[:, None] * stride_bo, n_mask, offs_r, rank, R8, ""))
        if UPCAST:
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        g = (g.to(tl.float32) + tl.dot(hg, bg, input_precision=PRECISION) * scale).to(g.dtype)
        u = (u.to(tl.float32) + tl.dot(hu, bu, input_precision=PRECISION) * scale).to(u.dtype)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(out_ptr.dtype.element_ty)  # silu_mul's fp32 math, rounded
        tl.store(o_rows + offs_n[None, :], (act.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=mask)


def silu_mul_lora(gate_up: torch.Tensor, h: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
                  slot_ranks: torch.Tensor, scalings: Optional[torch.Tensor] = None, *,
                  out: Optional[torch.Tensor] = None, block: int = 256, block_m: Optional[int] = None,
                  block_n: Optional[int] = None, cols_per_prog: Optional[int] = None,
                  num_stages: Optional[int] = None, num_warps: Optional[int] = None,
                  unroll: Optional[int] = None) -> torch.Tensor:
    """out = silu(gate + delta_gate) * (up + delta_up), the deltas those of lora_expand; returns out [T, I].

    gate_up [T, 2I] (columns contiguous), left unchanged; h [P, T, 2, R] or [T, 2, R] fp32; B [S, 2I, R]
    in gate_up's dtype; segs plus segs.base_rows cover every row once (base_rows None: the static
    decode batch); slot_ranks [S] int32; scalings [S] fp32 or None. block: the one-token body's
    columns per program; block_m, block_n, cols_per_prog, num_stages, num_warps, unroll: tile overrides.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul_lora: gate_up must be [T, 2I] with contiguous columns, got {tuple(gate_up.shape)}")
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    h4 = h if h.dim() == 4 else h.unsqueeze(0)
    if B.dim() != 3 or B.shape[1] != 2 * I or h4.dim() != 4 or h4.shape[1:3] != (T, 2) or h4.shape[3] != B.shape[2]:
        raise ValueError(f"silu_mul_lora: shapes disagree: gate_up {tuple(gate_up.shape)}, h {tuple(h.shape)}, "
                         f"B {tuple(B.shape)}")
    if h.dtype != torch.float32 or not h4.is_contiguous():
        raise ValueError(f"silu_mul_lora: h must be contiguous fp32 (lora_shrink's output), got {h.dtype}")
    if gate_up.dtype != B.dtype or gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"silu_mul_lora: gate_up and B must share one of fp32/bf16/fp16, got {gate_up.dtype}, "
                         f"{B.dtype}")
    if segs.num_segs == 0:
        raise ValueError("silu_mul_lora: no segment (a step without adapter rows takes silu_mul)")
    if segs.max_len != 1 and segs.base_rows is None and not segs.static_sorted:
        raise ValueError(f"silu_mul_lora: segments longer than one token ({segs.max_len}) must list the base "
                         "rows (segs.base_rows)")
    if unroll and unroll < h4.shape[0]:
        raise ValueError(f"silu_mul_lora: unroll {unroll} must cover the {h4.shape[0]} planes of h (or be 0: a loop)")
    if block < 16 or block & (block - 1):
        raise ValueError(f"silu_mul_lora: block must be a power of two >= 16, got {block}")
    S, R = B.shape[0], B.shape[2]
    check_out_slices("silu_mul_lora", gate_up, [0, I, 2 * I], 2, R, segs, slot_ranks, S, scalings)
    G = segs.num_segs
    num_base = 0 if segs.base_rows is None else segs.base_rows.shape[0]
    covered = rows_covered(segs)
    if covered != T:
        raise ValueError(f"silu_mul_lora: the segments and base rows must cover every row of gate_up once: "
                         f"{covered} != {T}")
    if out is None:
        out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (T, I) or out.dtype != gate_up.dtype or out.stride(1) != 1:
        raise ValueError(f"silu_mul_lora: out must be [{T}, {I}] {gate_up.dtype}, columns contiguous")
    if T == 0 or I == 0:
        return out
    pdl = pdl_available(gate_up.device)
    tok = segs.token_index if segs.token_index is not None else segs.starts
    base = segs.base_rows if num_base else slot_ranks  # a valid int32 pointer; not read without base rows
    block_r = max(16, triton.next_power_of_2(R))
    if segs.max_len > 1 or segs.static_sorted:
        # the one-token body has no segment length: sorted_segments_device's empty tail segments
        # (length 0, start 0) would each write row token_index[0] again, without its delta
        return _launch_tiles(gate_up, out, h4, B, segs, slot_ranks, scalings, tok, base, num_base, block_r,
                             block_m, block_n, cols_per_prog, num_stages, num_warps, pdl, unroll)
    block = min(block, max(16, triton.next_power_of_2(I)))
    _silu_mul_lora_kernel[(G + num_base, triton.cdiv(I, block))](
        gate_up, out, h4, B, scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.slots,
        slot_ranks, base,
        I, R, G, h4.shape[0],
        gate_up.stride(0), out.stride(0), h4.stride(1), h4.stride(3), h4.stride(0),
        B.stride(0), B.stride(1), B.stride(2),
        BLOCK=block, BLOCK_R=block_r, GATHER=segs.token_index is not None,
        HAS_SCALE=scalings is not None, R8=R % 8 == 0, num_warps=4, **pdl_launch(pdl),
    )
    return out


# The tile body's tile and grid (about TILE_WAVES programs an SM), tuned for gate_up_proj prefill.
TILE_M, TILE_N, TILE_WAVES, TILE_STAGES = 32, 64, 8, 3


def _launch_tiles(gate_up, out, h4, B, segs, slot_ranks, scalings, tok, base, num_base, block_r, block_m, block_n,
                  cols_per_prog, num_stages, num_warps, pdl, unroll) -> torch.Tensor:
    """silu_mul_lora's tile body (multi-token segments; operands checked by silu_mul_lora)."""
    T, I = out.shape
    R = B.shape[2]
    if block_m is None:
        ml = segs.max_len
        block_m = 16 if ml <= 16 else TILE_M
    if block_n is None:
        block_n = TILE_N
    block_n = min(block_n, max(16, triton.next_power_of_2(I)))
    check_tile(block_m=block_m, block_n=block_n)
    G = segs.num_segs
    tiles_per_seg = triton.cdiv(segs.max_len, block_m)
    programs_m = G * tiles_per_seg + triton.cdiv(num_base, block_m)
    n_steps = triton.cdiv(I, block_n)
    if cols_per_prog is None:
        splits = n_steps  # interpreter: a program per column step
        if gate_up.device.type == "cuda":
            sms = torch.cuda.get_device_properties(gate_up.device).multi_processor_count
            splits = max(1, min(n_steps, triton.cdiv(TILE_WAVES * sms, programs_m)))
        cols_per_prog = triton.cdiv(n_steps, splits) * block_n
    if cols_per_prog % block_n:
        raise ValueError(f"silu_mul_lora: cols_per_prog {cols_per_prog} must be a multiple of block_n {block_n}")
    grid = (programs_m, triton.cdiv(I, cols_per_prog))
    _silu_mul_lora_tile_kernel[grid](
        gate_up, out, h4, B, scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.lens,
        segs.slots, slot_ranks, base,
        I, R, G, tiles_per_seg, num_base, h4.shape[0], cols_per_prog,
        gate_up.stride(0), out.stride(0), h4.stride(1), h4.stride(3), h4.stride(0),
        B.stride(0), B.stride(1), B.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, STAGES=num_stages or TILE_STAGES,
        GATHER=segs.token_index is not None, HAS_SCALE=scalings is not None,
        PRECISION="ieee" if B.dtype == torch.float32 else "tf32", UPCAST=dot_upcast(B.dtype), R8=R % 8 == 0,
        PLANES_UNROLL=planes_unroll(h4.shape[0], block_m) if unroll is None else unroll,
        num_warps=num_warps or 4, **pdl_launch(pdl),
    )
    return out
