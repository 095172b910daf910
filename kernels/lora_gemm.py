"""lora_gemm: the base projection's GEMM with the multi-LoRA delta added in its epilogue (prefill).

    y[t, c] = x[t] @ W[c]ᵀ + scale[slot(t)] * h[t, i(c)*R : i(c)*R + r] @ B[slot(t), c, :r]ᵀ
    h[t, i*R + j] = x[t] @ A[slot(t), i, j]ᵀ  (j < r)

i(c) is output column c's slice, r = rank[slot(t)], slot(t) = row_slots[t] (-1: base, no delta). One
launch writes y once: given A, column tile 0 of each row tile computes h first and raises a flag, and
every tile adds the delta after its own K loop once that flag is up (given h, no flags). A wait is
bounded (SPIN_LIMIT), then the tile computes h itself with the same bits: no deadlock on any block order.
Design and figures: docs/architecture.md "LoRA kernels", docs/performance.md.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kernels.lora_expand import check_out_slices
from kernels import platform, tile_config
from kernels.platform import dot_upcast
from kernels.tile_config import DeviceTiles, GemmTiles, block_n_for

_NO_SLOT = tl.constexpr(2**31 - 1)  # "no slot left" in the epilogue's walk over a tile's slots


@triton.jit
def lora_epilogue(acc, slots, offs_m, offs_n, c0, M, o1, o2, R, h_ptr, b_ptr, scale_ptr, rank_ptr, stride_hp,
                  stride_hm, stride_bs, stride_bn, n_parts, w_ty: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_R: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 (rows offs_m with slots `slots`, columns offs_n from c0, in one slice)
    plus every adapter's delta among the rows: one rank-R tensor-core product per distinct slot.
    Rank, B and h load together and are masked in registers, so padding may hold anything."""
    sl = (c0 >= o1).to(tl.int32) + (c0 >= o2).to(tl.int32)  # the tile's slice
    offs_r = tl.arange(0, BLOCK_R)
    r_cols = (offs_r < R)[None, :]
    # [BLOCK_N, R] of a slot's B in its own layout (R contiguous: wide loads), transposed in registers
    # below; every column is loaded (edge columns wrap, never stored)
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_r[None, :]
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + (sl * R + offs_r)[None, :]
    hraw = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for p in range(n_parts):  # K splits' partial sums, in a fixed order
        # from L2 (.cg): h may have been written by another SM during this launch
        hraw += tl.load(h_ptrs + p * stride_hp, mask=(offs_m < M)[:, None] & r_cols, other=0.0, cache_modifier=".cg")
    cur = tl.min(tl.where(slots >= 0, slots, _NO_SLOT))
    while cur != _NO_SLOT:
        # issued before anything waits on h's loads above
        rank = tl.load(rank_ptr + cur)
        braw = tl.load(b_rows + cur.to(tl.int64) * stride_bs, mask=r_cols, other=0.0)
        ht = tl.where((slots == cur)[:, None] & (offs_r < rank)[None, :], hraw, 0.0)
        if HAS_SCALE:
            ht = ht * tl.load(scale_ptr + cur)
        ht = ht.to(w_ty)
        bt = tl.trans(tl.where((offs_r < rank)[None, :], braw, 0.0).to(w_ty))
        if UPCAST:
            ht = ht.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(ht, bt, acc, input_precision=PRECISION)
        cur = tl.min(tl.where(slots > cur, slots, _NO_SLOT))
    return acc


@triton.jit
def _tile_of(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles sweep the columns together, so a W tile is read from HBM once
    per group rather than once per row tile."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def _shrink_tile(xs_desc, as_desc, h_ptr, rank_ptr, slots, m0, K, R, NR, stride_hm,
                 BLOCK_M: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_NR: tl.constexpr,
                 SHRINK_STAGES: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """h [BLOCK_M rows from m0, all n*R columns] for every adapter among the rows: one K loop each.
    A's rows load as one block from the slot's first row; rows past its n*R or rank land in unstored columns."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_NR)  # column j = i*R + rank row of slice i
    cur = tl.min(tl.where(slots >= 0, slots, _NO_SLOT))
    while cur != _NO_SLOT:
        rank = tl.load(rank_ptr + cur)
        acc = tl.zeros((BLOCK_M, BLOCK_NR), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BLOCK_KS), num_stages=SHRINK_STAGES):
            xt = xs_desc.load([m0, k * BLOCK_KS])
            at = as_desc.load([cur * NR, k * BLOCK_KS])
            if UPCAST:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            acc = tl.dot(xt, at.T, acc, input_precision=PRECISION)
        j_mask = (offs_j < NR) & (offs_j % R < rank)
        tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_j[None, :], acc,
                 mask=(slots == cur)[:, None] & j_mask[None, :])
        cur = tl.min(tl.where(slots > cur, slots, _NO_SLOT))


@triton.jit
def _wait_h(flag, xs_desc, as_desc, h_ptr, rank_ptr, slots, m0, K, R, NR, stride_hm, BLOCK_M: tl.constexpr,
            BLOCK_KS: tl.constexpr, BLOCK_NR: tl.constexpr, SHRINK_STAGES: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """Wait for the row tile's h (its flag raised by column tile 0, which came first)."""
    spins = 0
    while (tl.atomic_add(flag, 0, sem="acquire", scope="gpu") == 0) & (spins < SPIN_LIMIT):
        spins += 1
    if spins >= SPIN_LIMIT:
        # Column tile 0 may not have started (block order is usual, not promised): compute h here,
        # same code and bits, so the second store is harmless and no tile waits forever.
        _shrink_tile(xs_desc, as_desc, h_ptr, rank_ptr, slots, m0, K, R, NR, stride_hm,
                     BLOCK_M, BLOCK_KS, BLOCK_NR, SHRINK_STAGES, PRECISION, UPCAST)
        tl.debug_barrier()  # this program's h stores before its own epilogue reads them


@triton.jit(do_not_specialize=["n_parts", "stride_hp"])
def _lora_gemm_kernel(
    x_desc,  # TMA descriptor of x [M, K], blocks [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of W [N, K], blocks [BLOCK_N, BLOCK_K]
    y_desc,  # TMA descriptor of y [M, N], blocks [BLOCK_M, BLOCK_N] (written)
    h_ptr,  # [P, M, n*R] fp32: from lora_shrink (P planes of partial sums), or (FUSED_SHRINK) [M, n*R] written here
    xs_desc,  # TMA descriptor of x, blocks [BLOCK_M, BLOCK_KS] (FUSED_SHRINK only)
    as_desc,  # TMA descriptor of A as [S*n*R, K], blocks [BLOCK_NR, BLOCK_KS] (FUSED_SHRINK only)
    b_ptr,  # [S, N, R] B of every slot
    scale_ptr,  # [S] fp32 (HAS_SCALE only)
    row_slot_ptr,  # [M] int32 slot of each row, -1 = base token
    rank_ptr,  # [S] int32 true rank per slot
    flag_ptr,  # [cdiv(M, BLOCK_M)] int32, zeroed: "row tile's h written" flags (FUSED_SHRINK)
    M, N, K, R, NR, o1, o2,  # NR = n*R; first columns of slices 1 and 2 (= N when absent)
    stride_hp, stride_hm, stride_bs, stride_bn,
    n_parts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_NR: tl.constexpr, BLOCK_KS: tl.constexpr, SHRINK_STAGES: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, NUM_PROGS: tl.constexpr, SPIN_LIMIT: tl.constexpr,
    FUSED_SHRINK: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:  # NUM_PROGS programs walk the tiles in order (no launch ramp per tile)
        last = num_pid_m * num_pid_n
    else:  # one tile a program
        last = tl.program_id(0) + 1
    for tile in tl.range(tl.program_id(0), last, NUM_PROGS):
        pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        offs_m = m0 + tl.arange(0, BLOCK_M)
        slots = tl.load(row_slot_ptr + offs_m, mask=offs_m < M, other=-1)
        if FUSED_SHRINK:
            if pid_n == 0:
                # h first, so the row tile's other column tiles find it ready after their main loops.
                _shrink_tile(xs_desc, as_desc, h_ptr, rank_ptr, slots, m0, K, R, NR, stride_hm,
                             BLOCK_M, BLOCK_KS, BLOCK_NR, SHRINK_STAGES, PRECISION, UPCAST)
                tl.debug_barrier()  # every thread's h stores before the release below
                tl.atomic_xchg(flag_ptr + pid_m, 1, sem="release", scope="gpu")
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The copy engine loads the tiles (edges zero-filled), num_stages deep; the tensor cores eat them.
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([m0, k * BLOCK_K])
            b = w_desc.load([n0, k * BLOCK_K])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        offs_n = (n0 + tl.arange(0, BLOCK_N)) % N  # edge columns wrap for B's load, clipped on store
        if tl.max(slots) >= 0:  # an adapter row
            if FUSED_SHRINK:  # wait for the row tile's h (column tile 0 came first)
                _wait_h(flag_ptr + pid_m, xs_desc, as_desc, h_ptr, rank_ptr, slots, m0, K, R, NR, stride_hm,
                        BLOCK_M, BLOCK_KS, BLOCK_NR, SHRINK_STAGES, PRECISION, UPCAST, SPIN_LIMIT)
            # B loads after the wait: issued before it, they held registers across the fallback shrink (spills).
            acc = lora_epilogue(acc, slots, offs_m, offs_n, n0, M, o1, o2, R, h_ptr, b_ptr, scale_ptr, rank_ptr,
                                stride_hp, stride_hm, stride_bs, stride_bn, n_parts, w_desc.dtype, BLOCK_M,
                                BLOCK_R, HAS_SCALE, PRECISION, UPCAST)
        y_desc.store([m0, n0], acc.to(y_desc.dtype))  # out-of-bounds rows/columns are not written


# Polls of a row tile's flag before a tile computes that row tile's h itself (see the kernel's wait).
SPIN_LIMIT = 20000


@functools.lru_cache(maxsize=None)
def device_tiles(device: torch.device) -> DeviceTiles:
    """This device's tile file (kernels/configs/): by the GPU's name on CUDA, cpu.json for the interpreter."""
    return tile_config.for_device(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


@functools.lru_cache(maxsize=None)
def descriptors_available() -> bool:
    """Whether this triton has host-side TMA descriptors (triton.tools.tensor_descriptor, triton >= 3.4)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def platform_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None when lora_gemm runs on `device` in `dtype`, else why not: triton's host-side TMA
    descriptors, and on CUDA an sm90+ GPU (the copy engine) and bf16/fp16. lora_linear's automatic
    choice and the LoRA manager's start-up check ask the same question through this."""
    if not descriptors_available():
        return f"triton {triton.__version__} has no host-side TMA descriptors (triton >= 3.4 does)"
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device)[0] < 9:
            return f"{torch.cuda.get_device_name(device)} has no TMA copy engine (sm90+ needed)"
        if dtype == torch.float32:
            # fp32 operands through this kernel gave NaN where bf16/fp16 matched torch.
            return "fp32 on CUDA is not supported (bf16/fp16 only)"
    return None


def unfit_reason(x: torch.Tensor, weight: torch.Tensor, out_offsets: Sequence[int]) -> Optional[str]:
    """None when lora_gemm takes these operands, else why not: platform_reason, the copy engine's rules
    (row-major rows on 16-byte boundaries) and a column tile inside one slice."""
    reason = platform_reason(x.device, x.dtype)
    if reason is not None:
        return reason
    for name, t in (("x", x), ("weight", weight)):
        if t.dim() != 2 or t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name} must be row-major with rows on 16-byte boundaries"
    if (weight.shape[0] * x.element_size()) % 16:
        return "the output's rows must be a multiple of 16 bytes"
    if block_n_for(out_offsets, 256) == 0:
        return f"no column tile >= 16 divides the slice boundaries {list(out_offsets)}"
    return None


def lora_gemm(x: torch.Tensor, weight: torch.Tensor, h: Optional[torch.Tensor], B: torch.Tensor,
              row_slots: torch.Tensor, slot_ranks: torch.Tensor, out_offsets: Sequence[int],
              scalings: Optional[torch.Tensor] = None, *, A: Optional[torch.Tensor] = None,
              tiles: Optional[GemmTiles] = None) -> torch.Tensor:
    """y = x @ weightᵀ + the multi-LoRA delta, as a new [T, out] tensor.

    x [T, in] and weight [out, in] (fp32/bf16/fp16, one dtype, see unfit_reason); h: None with A
    [S, n, R, in] given (the shrink runs inside this launch), or [T, n, R] / [P, T, n, R] fp32 from
    lora_shrink (planes summed); B [S, out, R] same dtype as x; row_slots [T] int32 (slot of each row,
    -1 = base); slot_ranks [S] int32; out_offsets [n + 1] slice boundaries; scalings [S] fp32 or None.
    tiles: the launch configuration (None = this device's entry for [out, in] in kernels/configs/).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"lora_gemm: x must be [T, in] and weight [out, in], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or B.dtype != x.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"lora_gemm: x, weight and B must share one of fp32/bf16/fp16, got {x.dtype}, "
                         f"{weight.dtype}, {B.dtype}")
    T, K = x.shape
    N = weight.shape[0]
    n = len(out_offsets) - 1
    if B.dim() != 3 or B.shape[1] != N or B.stride(2) != 1:
        raise ValueError(f"lora_gemm: B must be [S, {N}, R] with R contiguous, got {tuple(B.shape)}")
    S, _, R = B.shape
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    # the slices, the rank bound and the scalings as lora_expand checks them; rows come as row_slots below
    out_offsets = check_out_slices("lora_gemm", y, out_offsets, n, R, None, slot_ranks, S, scalings)
    reason = unfit_reason(x, weight, out_offsets)
    if reason is not None:
        raise ValueError(f"lora_gemm: {reason}")
    fused = h is None
    if fused:
        if A is None or A.shape != (S, n, R, K) or A.dtype != x.dtype or not A.is_contiguous():
            raise ValueError(f"lora_gemm: without h, A must be a contiguous {x.dtype} [{S}, {n}, {R}, {K}], got "
                             f"{None if A is None else (A.dtype, tuple(A.shape))}")
        h4 = torch.empty(1, T, n, R, dtype=torch.float32, device=x.device)  # written by the shrink tiles
    else:
        h4 = h if h.dim() == 4 else h.unsqueeze(0)
        if h4.dtype != torch.float32 or tuple(h4.shape[1:]) != (T, n, R) or h4.stride(3) != 1 or h4.stride(2) != R:
            raise ValueError(f"lora_gemm: h must be fp32 [(P,) {T}, {n}, {R}] with [n, R] contiguous, got "
                             f"{h.dtype} {tuple(h.shape)}")
    for name, t, size in (("row_slots", row_slots, T), ("slot_ranks", slot_ranks, S)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != size or t.device != x.device:
            raise ValueError(f"lora_gemm: {name} must be int32 [{size}] on {x.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    dev_tiles = device_tiles(x.device)
    launch = dev_tiles.gemm_launch(dev_tiles.gemm(N, K) if tiles is None else tiles, out_offsets, R)
    block_m, block_n, block_k = launch.block_m, launch.block_n, launch.block_k
    persistent, group_m = launch.persistent, launch.group_m
    if T == 0:
        return y
    o1 = out_offsets[1] if n > 1 else N
    o2 = out_offsets[2] if n > 2 else N
    num_pid_m = triton.cdiv(T, block_m)
    num_tiles = num_pid_m * triton.cdiv(N, block_n)
    if persistent and fused and platform.interpreter_active():
        persistent = False  # the interpreter runs programs one after another: a wait would never end
    # NUM_PROGS is constant off the persistent grid so token counts do not compile new variants mid-serving.
    progs, grid = 1, num_tiles
    if persistent:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else 4
        progs = grid = min(num_tiles, sms)
    # row tiles' "h written" flags; without FUSED_SHRINK never read (no memset)
    flags = torch.zeros(num_pid_m, dtype=torch.int32, device=x.device) if fused else slot_ranks
    block_nr = max(16, triton.next_power_of_2(n * R))
    block_ks, shrink_stages = launch.block_ks, launch.shrink_stages
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    if fused:
        xs_desc = TensorDescriptor.from_tensor(x, [block_m, block_ks])
        as_desc = TensorDescriptor.from_tensor(A.view(S * n * R, K), [block_nr, block_ks])
    else:
        xs_desc = as_desc = x_desc  # not read without FUSED_SHRINK
    _lora_gemm_kernel[(grid,)](
        x_desc, TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(y, [block_m, block_n]),
        h4, xs_desc, as_desc, B, scalings if scalings is not None else slot_ranks, row_slots, slot_ranks, flags,
        T, N, K, R, n * R, o1, o2,
        h4.stride(0), h4.stride(1), B.stride(0), B.stride(1),
        h4.shape[0],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_NR=block_nr, BLOCK_KS=block_ks, SHRINK_STAGES=shrink_stages, GROUP_M=group_m, PERSISTENT=persistent,
        NUM_PROGS=progs, SPIN_LIMIT=SPIN_LIMIT, FUSED_SHRINK=fused, HAS_SCALE=scalings is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=dot_upcast(x.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return y
