"""silu_mul_lora: gate_up_proj's LoRA expand fused into the MLP's activation, for one-token segments (decode).

    g = gate_up[t, j]     + scale[s] * h[t, 0, :r] · B[s, j, :r]          s = slot(t), r = rank[s]
    u = gate_up[t, I + j] + scale[s] * h[t, 1, :r] · B[s, I + j, :r]      (no delta for base rows)
    out[t, j] = silu(g) * u

what lora_expand (add mode) into gate_up followed by silu_mul computes, with the same roundings (h
summed over the shrink's planes in fp32 and rounded to B's dtype, g and u rounded to gate_up's dtype
before the activation), in one launch instead of two. The expand's read-modify-write of the [T, 2I]
gate_up output goes (2 x 7.3 MB a layer at batch 64 on Llama-3.1-8B), and so does one launch with
its ramp and tail; gate_up's B (58.7 MB a layer at 64 distinct rank-16 adapters) streams in the
activation's pass. With PDL (sm90+) a program loads its B tiles before it waits for the kernel before
it (the base GEMM): B is an adapter weight, which no kernel of the step writes.

Rows: program p < G takes segment p's one token (its slot; -1 = a base or padding row of the static
decode batch, no delta); programs G.. take segs.base_rows (eager decode lists base tokens there).
Every row of gate_up must be one or the other. h: lora_shrink's partials=True planes [P, T, 2, R].
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_wait, pdl_launch
from kernels.lora_expand import check_out_slices
from kernels.platform import pdl_available
from kernels.segment_tile import segment_row
from kernels.segments import LoRASegments, rows_covered


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
    PDL: tl.constexpr,
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
    bm = mask[:, None] & r_mask[None, :]
    bg = tl.load(b_rows + offs[:, None] * stride_bo, mask=bm, other=0.0)  # [BLOCK, BLOCK_R]
    bu = tl.load(b_rows + (I + offs)[:, None] * stride_bo, mask=bm, other=0.0)
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


def silu_mul_lora(gate_up: torch.Tensor, h: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
                  slot_ranks: torch.Tensor, scalings: Optional[torch.Tensor] = None, *,
                  out: Optional[torch.Tensor] = None, block: int = 256) -> torch.Tensor:
    """out = silu(gate + delta_gate) * (up + delta_up), the deltas those of lora_expand; returns out [T, I].

    gate_up [T, 2I] fp32/bf16/fp16 (rows may be strided, columns contiguous), left unchanged;
    h [P, T, 2, R] fp32 (lora_shrink partials=True; [T, 2, R] = one plane); B [S, 2I, R] in gate_up's
    dtype; segs: one-token segments (max_len 1) whose rows together with segs.base_rows cover every
    row of gate_up once (or, with base_rows None, one segment per row: the static decode batch);
    slot_ranks [S] int32; scalings [S] fp32 or None (= 1). block: columns per program (power of 2).
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
    if segs.max_len != 1:
        raise ValueError(f"silu_mul_lora: takes one-token segments, the longest is {segs.max_len}")
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
    block = min(block, max(16, triton.next_power_of_2(I)))
    pdl = pdl_available(gate_up.device)
    tok = segs.token_index if segs.token_index is not None else segs.starts
    base = segs.base_rows if num_base else slot_ranks  # a valid int32 pointer; not read without base rows
    _silu_mul_lora_kernel[(G + num_base, triton.cdiv(I, block))](
        gate_up, out, h4, B, scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.slots,
        slot_ranks, base,
        I, R, G, h4.shape[0],
        gate_up.stride(0), out.stride(0), h4.stride(1), h4.stride(3), h4.stride(0),
        B.stride(0), B.stride(1), B.stride(2),
        BLOCK=block, BLOCK_R=max(16, triton.next_power_of_2(R)), GATHER=segs.token_index is not None,
        HAS_SCALE=scalings is not None, num_warps=4, **pdl_launch(pdl),
    )
    return out
