"""lora_shrink: the first half of a multi-LoRA projection, every slice of a fused projection at once.

    h[t, i*R + j] = x[t] · A[slot(t), i, j]    for j < rank[slot(t)], every slice i, adapter tokens t

A[s] [n, R, in] is read as one [n*R, in] matrix, so x is read once per tile, not once per slice.
Rank padding is never loaded nor written, and base tokens (no segment) cost nothing. BLOCK_M = 1 is
a GEMV body (kernels/lora_bodies.py), BLOCK_M >= 16 uses tl.dot. Small grids split K: fp32 atomics
into a zeroed h, or (partials) one plane of partial sums per split that lora_expand adds.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_launch_dependents
from kernels.lora_bodies import gemv_shrink
from kernels.platform import dot_upcast, pdl_available
from kernels.segment_tile import segment_row, segment_rows, segment_tile
from kernels.segments import LoRASegments, check_segments, check_tile


# Most K splits the partial-sum mode picks by itself: lora_expand adds the planes one by one, unrolled.
MAX_PLANES = 16
# Most of K one program of a split shrink covers on the decode graphs' sorted chunks (see _plane_count).
DECODE_K_PER_SPLIT = 1024


@triton.jit(do_not_specialize=["tiles_per_seg", "stride_hp"])  # vary every step: no recompiles
def _lora_shrink_kernel(
    x_ptr,  # [T, K] input rows (fp32/bf16/fp16)
    a_ptr,  # [S, N, K] A of every slot, N = n*R: row i*R + j = rank row j of slice i
    h_ptr,  # [T, N] fp32 output
    tok_ptr,  # [P] int32 token row per position (GATHER only)
    seg_start_ptr,  # [G] int32 first position of each segment
    seg_len_ptr,  # [G] int32 positions in each segment
    seg_slot_ptr,  # [G] int32 slot of each segment
    rank_ptr,  # [S] int32 true rank of each slot (0 = empty slot)
    K, N, R,  # in features, n*R, max rank
    stride_xt, stride_xk, stride_as, stride_an, stride_ak, stride_ht, stride_hn,
    stride_hp,  # K split -> its plane of partial sums (0: one plane, stores or atomics)
    tiles_per_seg,  # cdiv(longest segment, BLOCK_M)
    k_per_split,  # K range of one program along grid axis 2 (a multiple of BLOCK_K)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    LAUNCH_DEPS: tl.constexpr,
):
    if LAUNCH_DEPS:
        # The next kernel (lora_expand, pdl=True) may launch once every program here has started: it
        # loads its B tiles meanwhile and waits for this grid's h in-kernel.
        gdc_launch_dependents()
    seg, m0, seg_len, slot, rank = segment_tile(tl.program_id(0), tiles_per_seg, seg_len_ptr, seg_slot_ptr,
                                                rank_ptr, BLOCK_M)
    if m0 >= seg_len:
        return  # this segment is shorter than the longest one
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N) & ((offs_n % R) < rank)
    if tl.max(n_mask.to(tl.int32), axis=0) == 0:
        return  # the whole column tile is rank padding (or the slot is empty)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_n * stride_an  # [BLOCK_N]
    h_ptr += tl.program_id(2) * stride_hp  # partial-sum mode: this K split's own [T, N] plane
    if BLOCK_M == 1:
        # GEMV body (one-token segments): A tiles [BLOCK_N, BLOCK_K] in A's own layout (K
        # contiguous), products summed elementwise in fp32 and reduced over K once at the end.
        row = segment_row(seg_start_ptr, tok_ptr, seg, m0, GATHER)
        acc1 = gemv_shrink(x_ptr + row * stride_xt, a_rows, n_mask, k_lo, k_hi, stride_xk, stride_ak,
                           BLOCK_N, BLOCK_K)  # [BLOCK_N] fp32
        h_ptrs1 = h_ptr + row * stride_ht + offs_n * stride_hn
        if ATOMIC:
            tl.atomic_add(h_ptrs1, acc1, mask=n_mask)
        else:
            tl.store(h_ptrs1, acc1, mask=n_mask)
    else:
        rows, m_mask = segment_rows(seg_start_ptr, tok_ptr, seg, m0, seg_len, BLOCK_M, GATHER)
        x_rows = x_ptr + rows[:, None] * stride_xt
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            xt = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_rows[None, :] + offs_k[:, None] * stride_ak, mask=n_mask[None, :] & k_mask[:, None],
                         other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            acc += tl.dot(xt, at, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N], fp32
        h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_n[None, :] * stride_hn
        out_mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(h_ptrs, acc, mask=out_mask)
        else:
            tl.store(h_ptrs, acc, mask=out_mask)

def lora_shrink(x: torch.Tensor, A: torch.Tensor, segs: LoRASegments, slot_ranks: torch.Tensor,
                out: Optional[torch.Tensor] = None, split_k: Optional[int] = None, *,
                block_m: Optional[int] = None, block_k: Optional[int] = None,
                num_warps: Optional[int] = None, block_n: Optional[int] = None,
                num_stages: Optional[int] = None, partials: bool = False,
                launch_dependents: bool = False) -> torch.Tensor:
    """h[t, i, :r] = x[t] @ A[slot(t), i, :r]ᵀ for every slice i, r = slot_ranks[slot(t)].

    x [T, in]; A [S, n, R, in] same dtype, contiguous; slot_ranks [S] int32; out: optional [T, n, R]
    fp32. Returns h [T, n, R] fp32; only adapter tokens' h[t, i, :rank] is written (lora_expand reads
    nothing else). split_k: None = from the grid size (>1 zeroes h). block_m, block_k, num_warps,
    block_n, num_stages: tile overrides. partials: splits store planes [P, T, n, R] instead of atomics.
    launch_dependents: let a PDL dependent (lora_expand pdl=True) start early (sm90+; else a no-op).
    """
    if x.dim() != 2 or A.dim() != 4:
        raise ValueError(f"lora_shrink: x must be [T, in] and A [S, n, R, in], got {tuple(x.shape)}, {tuple(A.shape)}")
    T, K = x.shape
    S, n, R, K_a = A.shape
    if K_a != K:
        raise ValueError(f"lora_shrink: A's in features {K_a} != x's {K}")
    if x.dtype != A.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"lora_shrink: x and A must share one of fp32/bf16/fp16, got {x.dtype}, {A.dtype}")
    if not A.is_contiguous():
        raise ValueError("lora_shrink: A must be contiguous (its [n, R] dims are read as one)")
    check_segments(segs, slot_ranks, S, x.device)
    if partials and out is not None:
        split_k = out.shape[0] if out.dim() == 4 else -1
    want = (split_k, T, n, R) if partials else (T, n, R)
    if out is not None and (out.shape != want or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"lora_shrink: out must be a contiguous fp32 {list(want)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    G = segs.num_segs
    N = n * R
    if block_m is None:
        # One-token segments: the GEMV body. Else tensor-core tiles as tall as the segments allow.
        ml = segs.max_len
        # merged decode segments are bound by their few programs: short tiles; 128-row tiles for long prefills only
        block_m = 1 if ml == 1 else (16 if ml <= 16 else (32 if ml <= 256 else (64 if ml <= 512 else 128)))
        if not partials and split_k is None and x.device.type == "cuda":
            block_m = _unsplit_block_m(block_m, G, ml, N, torch.cuda.get_device_properties(x.device).multi_processor_count)
    if block_n is None:
        # GEMV: one rank block per program; tensor-core tiles: one column tile covers every slice, x read once.
        block_n = max(16, triton.next_power_of_2(R)) if block_m == 1 else 64
    block_n = min(block_n, max(16, triton.next_power_of_2(N)))
    if block_k is None:
        # tuned K steps (docs/performance.md)
        if block_m == 1:
            block_k = max(16, 8192 // block_n)  # [BLOCK_N, BLOCK_K] fp32 partial sums: 64 per thread
        else:
            # wider K steps for 128-row prefill tiles and short segments (tuned)
            block_k = 128 if (segs.max_len <= 16 or block_m >= 128) else 64
        block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4  # 128-row prefill tiles, 8 warps
    if num_stages is None:
        num_stages = 3
    if block_m != 1:
        check_tile(block_m=block_m)
    check_tile(block_k=block_k, block_n=block_n)
    tiles_per_seg = triton.cdiv(segs.max_len, block_m)
    grid_mn = G * tiles_per_seg * triton.cdiv(N, block_n)
    if split_k is None:
        split_k = _auto_split_k(grid_mn, K, block_k, block_m, x.device)
        if partials:
            split_k = _plane_count(split_k, K, segs.static_sorted)
    if split_k < 1:
        raise ValueError(f"lora_shrink: split_k must be >= 1, got {split_k}")
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    if not partials:
        split_k = triton.cdiv(K, k_per_split)  # planes past K would be all zero: none
    if out is None:
        shape = (split_k, T, n, R) if partials else (T, n, R)
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    if G == 0 or T == 0:
        return out
    if split_k > 1 and not partials:
        out.zero_()
    h2 = out.view(-1, N)  # [P*T, N]: plane p starts at row p*T
    a3 = A.view(S, N, K)
    tok = segs.token_index if segs.token_index is not None else segs.starts  # unused when not GATHER
    grid = (G * tiles_per_seg, triton.cdiv(N, block_n), split_k)
    _lora_shrink_kernel[grid](
        x, a3, h2, tok, segs.starts, segs.lens, segs.slots, slot_ranks,
        K, N, R,
        x.stride(0), x.stride(1), a3.stride(0), a3.stride(1), a3.stride(2), h2.stride(0), h2.stride(1),
        T * N if partials else 0, tiles_per_seg, k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GATHER=segs.token_index is not None, ATOMIC=split_k > 1 and not partials,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=dot_upcast(x.dtype),
        LAUNCH_DEPS=launch_dependents and pdl_available(x.device),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _plane_count(split_k: int, K: int, sorted_decode: bool) -> int:
    """Planes of a partials=True shrink split split_k ways: at most MAX_PLANES; on the decode graphs'
    sorted chunks at most DECODE_K_PER_SPLIT of K per plane (summing planes costs the expand little)."""
    if split_k > 1 and sorted_decode:
        split_k = max(split_k, triton.cdiv(K, DECODE_K_PER_SPLIT))
    return min(split_k, MAX_PLANES)


def _unsplit_block_m(block_m: int, num_segs: int, max_len: int, N: int, sms: int) -> int:
    """Row-tile height for a shrink whose K splits would add atomically: halve tall tiles while their
    grid is too small to run unsplit (_auto_split_k), so more, shorter tiles fill the SMs instead."""
    block_n = min(64, max(16, triton.next_power_of_2(N)))  # the tensor-core tiles' column block
    while block_m > 32 and num_segs * triton.cdiv(max_len, block_m) * triton.cdiv(N, block_n) < _unsplit_floor(
            block_m, sms):
        block_m //= 2
    return block_m


def _unsplit_floor(block_m: int, sms: int) -> int:
    """Programs from which a shrink grid runs without a K split (see _auto_split_k)."""
    return sms // 4 if block_m > 16 else 2 * sms


def _auto_split_k(grid_mn: int, K: int, block_k: int, block_m: int, device: torch.device) -> int:
    """Split K only where the grid is too small to keep every SM streaming A, with >= 2 K blocks per
    program: a split costs a memset and fp32 atomics, so prefill tiles split only below a quarter of
    the SMs, decode tiles below ~2 programs per SM."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if grid_mn >= _unsplit_floor(block_m, sms):
        return 1
    return max(1, min(triton.cdiv(2 * sms, grid_mn), K // (2 * block_k)))
