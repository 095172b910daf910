"""lora_streamk: lora_apply's one-slice decode delta with the work spread evenly over the SMs (stream-K).

    y[t] += scale[slot(t)] * (x[t] @ A[slot(t), 0, :r]ᵀ) @ B[slot(t), :, :r]ᵀ    every one-token segment t

The same math and rounding as lora_apply's fused kernel (kernels/lora_apply.py) for one-slice
projections (o_proj, down_proj), scheduled differently. The fused kernel gives each token one program
(its A, then its B); 256 tokens on 132 SMs leave 124 SMs with two programs and 8 with one, and the
kernel takes as long as an SM with two (H200: 264 tokens take no longer than 256, docs/benchmarks.md
round 11). Here a token is a row of U equal work units (KA tiles of A, [R, BLOCK_K], then NB tiles
of B, [BLOCK_N, R]: the same bytes when BLOCK_K = BLOCK_N), all tokens' units end to end, and P
programs take equal contiguous shares of them: program q the units [q*W/P, (q+1)*W/P). A token cut
by a share boundary is worked on by two (or, where a share is shorter than a token, three) programs:

- pass 1, no waits: each program computes its part of every cut token's h, x · A over its K tiles
  (a partial sum, or all of h when it holds the whole A), stores it in its own slot of a small fp32
  buffer and raises that slot's flag (release); whole tokens inside the share are done outright (h in
  registers, then B). The share's last (trailing) token goes first: it is what the next program waits
  on.
- pass 2: for each cut token whose B units it holds, a program waits for the flags of the programs
  that hold the token's A units (acquire), sums their partials in program order (the same order
  whoever sums them: the same bits) and streams its B units, adding into y.

A program waits only on programs that come before it in the order (A units precede B units) and that
never wait before they publish; every wait is bounded (SPIN_LIMIT polls), after which the program
computes the missing partial itself from A (the same code over the same K tiles: the same bits). The
last program to finish (a counter) zeroes the flags and the counter, so the buffer is clean for the
next launch (CUDA-graph replays included) without a memset.

Rounding differs from the fused kernel's only in how h's fp32 sum over K is grouped where a token is
cut (partials, summed in order), as lora_shrink's K splits do.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.platform import interpreter_active

# Polls of a producer's flag before a program computes that partial itself (see the module docstring).
SPIN_LIMIT = 20000
# The tiles (block_k = block_n, stages, warps): lora_apply's TMA body's (TMA_TILES), which keep a
# unit of A and of B the same bytes.
TILES = (256, 4, 4)
# Programs per SM by default.
PROGRAMS_PER_SM = 2

_WORKSPACE: dict = {}  # device -> (pub fp32 [n], flags int32 [m]): partial h slots and their flags


@triton.jit
def _program_start(q, UTOT, P):
    """First unit of program q's share."""
    return (q * UTOT) // P


@triton.jit
def _a_partial(x_desc, a_desc, row, a_row0, k_lo, k_hi, r_mask,
               BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """h's partial sum over A's K tiles k_lo .. k_hi of one token: [BLOCK_R] fp32, 0 past the rank."""
    acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)  # summed over K once, after the loop
    for k in tl.range(k_lo, k_hi, num_stages=STAGES):
        xt = x_desc.load([row, k * BLOCK_K])  # [1, BLOCK_K]; past K zero-filled
        at = a_desc.load([a_row0, k * BLOCK_K])  # [BLOCK_R, BLOCK_K]
        acc2 += at.to(tl.float32) * xt.to(tl.float32)
    return tl.where(r_mask, tl.sum(acc2, axis=1), 0.0)


@triton.jit
def _expand(y_row, b_desc, b_row0, hv, r_mask, c_lo, c_hi, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """y_row[c_lo:c_hi] += B[b_row0 + c, :] · hv (hv already rounded and scaled); y through pointers."""
    for c0 in tl.range(c_lo, c_hi, BLOCK_N, num_stages=STAGES):
        bt = b_desc.load([b_row0 + c0, 0])  # [BLOCK_N, BLOCK_R]
        cols = c0 + tl.arange(0, BLOCK_N)[None, :]
        yt = tl.load(y_row + cols, mask=cols < c_hi, other=0.0)
        bt = tl.where(r_mask[None, :], bt.to(tl.float32), 0.0)  # rank padding may hold anything
        acc = tl.sum(bt * hv[None, :], axis=1)
        tl.store(y_row + cols, (yt.to(tl.float32) + acc[None, :]).to(y_row.dtype.element_ty), mask=cols < c_hi)


@triton.jit
def _token(t, seg_start_ptr, seg_slot_ptr, rank_ptr, tok_ptr, GATHER: tl.constexpr):
    """(row, slot, rank) of one-token segment t; slot -1 (a static batch's padding) has rank 0."""
    slot = tl.load(seg_slot_ptr + t)
    rank = tl.where(slot < 0, 0, tl.load(rank_ptr + tl.maximum(slot, 0)))
    pos = tl.load(seg_start_ptr + t)
    if GATHER:
        row = tl.load(tok_ptr + pos)
    else:
        row = pos
    return row.to(tl.int32), tl.maximum(slot, 0), rank


@triton.jit
def _lora_streamk_kernel(
    x_desc,  # TMA descriptor of x [T, K], blocks [1, BLOCK_K]
    a_desc,  # TMA descriptor of A as [S*R, K], blocks [BLOCK_R, BLOCK_K] (BLOCK_R = R)
    b_desc,  # TMA descriptor of B as [S*OUT, R], blocks [BLOCK_N, BLOCK_R]
    y_ptr, stride_yt,  # [T, OUT] base output, updated in place (pointer loads and stores)
    scale_ptr,  # [S] fp32 (HAS_SCALE only)
    tok_ptr, seg_start_ptr, seg_slot_ptr, rank_ptr,  # one-token segments (kernels/segments.py)
    pub_ptr,  # [2P, BLOCK_R] fp32: program q's partial h of its first (2q) and last (2q+1) token
    flag_ptr,  # [2P + 1] int32, zero at launch (and left zero): the slots' flags, then the done counter
    K, OUT, R, KA, U, UTOT, P,  # KA = A's K tiles, U = KA + B's column tiles, UTOT = tokens * U
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, SPIN_LIMIT: tl.constexpr, PUBLISH: tl.constexpr,
):
    q = tl.program_id(0)
    u0 = _program_start(q, UTOT, P)
    u1 = _program_start(q + 1, UTOT, P)
    offs_r = tl.arange(0, BLOCK_R)
    if u1 > u0:
        t_first = u0 // U
        t_last = (u1 - 1) // U
        # Pass 1 (no waits), the trailing token first: every cut token's partial h, published; whole
        # tokens done outright.
        for j in range(0, t_last - t_first + 1):
            t = t_last - j
            lo = tl.maximum(u0 - t * U, 0)
            hi = tl.minimum(u1 - t * U, U)
            row, slot, rank = _token(t, seg_start_ptr, seg_slot_ptr, rank_ptr, tok_ptr, GATHER)
            r_mask = offs_r < rank
            if rank > 0:
                if (lo == 0) & (hi == U):
                    hv = _a_partial(x_desc, a_desc, row, slot * R, 0, KA, r_mask, BLOCK_R, BLOCK_K, STAGES)
                    hv = hv.to(b_desc.dtype).to(tl.float32)  # rounded to the weights' dtype, as lora_expand does
                    if HAS_SCALE:
                        hv = hv * tl.load(scale_ptr + slot)
                    _expand(y_ptr + row.to(tl.int64) * stride_yt, b_desc, slot * OUT, hv, r_mask, 0, OUT,
                            BLOCK_N, STAGES)
                elif lo < KA:
                    hv = _a_partial(x_desc, a_desc, row, slot * R, lo, tl.minimum(hi, KA), r_mask,
                                    BLOCK_R, BLOCK_K, STAGES)
                    if PUBLISH:
                        pub = 2 * q + (t != t_first).to(tl.int32)
                        tl.store(pub_ptr + pub * BLOCK_R + offs_r, hv)
                        tl.debug_barrier()  # every thread's stores before the release
                        tl.atomic_xchg(flag_ptr + pub, 1, sem="release", scope="gpu")
        # Pass 2: the B units of cut tokens, h summed from the partials of the programs holding A.
        for t in range(t_first, t_last + 1):
            lo = tl.maximum(u0 - t * U, 0)
            hi = tl.minimum(u1 - t * U, U)
            row, slot, rank = _token(t, seg_start_ptr, seg_slot_ptr, rank_ptr, tok_ptr, GATHER)
            r_mask = offs_r < rank
            if (rank > 0) & (hi > KA) & ((lo > 0) | (hi < U)):
                hv = tl.zeros((BLOCK_R,), dtype=tl.float32)
                a_lo = t * U  # the token's A units, held by programs p_lo .. p_hi
                p_lo = ((a_lo + 1) * P - 1) // UTOT
                p_hi = ((a_lo + KA) * P - 1) // UTOT
                for p in range(p_lo, p_hi + 1):
                    ps = _program_start(p, UTOT, P)
                    pub = 2 * p + (t != ps // U).to(tl.int32)
                    ok = tl.atomic_add(flag_ptr + pub, 0, sem="acquire", scope="gpu")
                    spins = 0
                    while (ok == 0) & (spins < SPIN_LIMIT):
                        ok = tl.atomic_add(flag_ptr + pub, 0, sem="acquire", scope="gpu")
                        spins += 1
                    if ok != 0:
                        part = tl.load(pub_ptr + pub * BLOCK_R + offs_r, cache_modifier=".cg")
                    else:
                        # Program p has not published (not started yet, or PUBLISH off): its partial
                        # here, from its own K tiles with the same code, so the same bits.
                        pe = _program_start(p + 1, UTOT, P)
                        part = _a_partial(x_desc, a_desc, row, slot * R, tl.maximum(ps - a_lo, 0),
                                          tl.minimum(pe - a_lo, KA), r_mask, BLOCK_R, BLOCK_K, STAGES)
                    hv += part
                hv = hv.to(b_desc.dtype).to(tl.float32)
                if HAS_SCALE:
                    hv = hv * tl.load(scale_ptr + slot)
                c_lo = (tl.maximum(lo, KA) - KA) * BLOCK_N
                c_hi = tl.minimum((hi - KA) * BLOCK_N, OUT)
                _expand(y_ptr + row.to(tl.int64) * stride_yt, b_desc, slot * OUT, hv, r_mask, c_lo, c_hi,
                        BLOCK_N, STAGES)
    # The last program out zeroes the flags and the counter for the next launch: every other program
    # has counted itself out, after its last read of a flag.
    tl.debug_barrier()
    done = tl.atomic_add(flag_ptr + 2 * P, 1, sem="acq_rel", scope="gpu")
    if done == P - 1:
        for i in range(0, 2 * P, 256):
            offs = i + tl.arange(0, 256)
            tl.store(flag_ptr + offs, tl.zeros((256,), dtype=tl.int32), mask=offs < 2 * P)
        tl.atomic_xchg(flag_ptr + 2 * P, 0)


def _workspace(device: torch.device, programs: int, block_r: int) -> Optional[tuple]:
    """The partial-h slots and flags for `programs` programs on `device` (zeroed once, left zero by
    every launch); None when a larger buffer would have to be allocated during CUDA-graph capture."""
    have = _WORKSPACE.get(device)
    if have is not None and have[0].numel() >= 2 * programs * block_r and have[1].numel() >= 2 * programs + 1:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    slots = max(2 * programs, have[1].numel() - 1 if have is not None else 0)
    _WORKSPACE[device] = (torch.zeros(slots * 64, dtype=torch.float32, device=device),  # max rank 64
                          torch.zeros(slots + 1, dtype=torch.int32, device=device))
    return _WORKSPACE[device]


def default_programs(device: torch.device) -> int:
    """PROGRAMS_PER_SM programs an SM (the interpreter: 4 programs, so the CPU tests cut tokens)."""
    if device.type != "cuda":
        return 4
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def launch_streamk(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs, slot_ranks: torch.Tensor,
                   scalings: Optional[torch.Tensor], *, programs: Optional[int] = None, block_k: Optional[int] = None,
                   num_stages: Optional[int] = None, num_warps: Optional[int] = None,
                   publish: bool = True) -> bool:
    """Run the stream-K kernel for lora_apply (one slice, one-token segments, operands already checked
    by lora_apply and its tma_unfit_reason). False when it cannot run now (a workspace it would have
    to allocate during CUDA-graph capture): the caller runs the fused kernel instead.
    programs: P (None = default_programs); block_k: the unit's columns (A's K step = B's column step);
    publish False: no program publishes, every cut token's partials are recomputed by their
    consumers (the fallback path, for the tests)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, K = x.shape
    S, n, R, _ = A.shape
    OUT = y.shape[1]
    if n != 1:
        raise ValueError(f"lora_streamk: one slice only, got {n}")
    d_bk, d_st, d_w = TILES
    bk = min(block_k or d_bk, 256)
    G = segs.num_segs
    KA = triton.cdiv(K, bk)
    U = KA + triton.cdiv(OUT, bk)
    P = max(1, min(programs or default_programs(y.device), G * U))
    ws = _workspace(y.device, P, R)
    if ws is None:
        return False
    pub, flags = ws
    tok = segs.token_index if segs.token_index is not None else segs.starts
    _lora_streamk_kernel[(P,)](
        TensorDescriptor.from_tensor(x, [1, bk]), TensorDescriptor.from_tensor(A.view(S * R, K), [R, bk]),
        TensorDescriptor.from_tensor(B.view(S * OUT, R), [bk, R]), y, y.stride(0),
        scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.slots, slot_ranks, pub, flags,
        K, OUT, R, KA, U, G * U, P,
        BLOCK_R=R, BLOCK_K=bk, BLOCK_N=bk, STAGES=num_stages or d_st, GATHER=segs.token_index is not None,
        HAS_SCALE=scalings is not None, SPIN_LIMIT=0 if interpreter_active() else SPIN_LIMIT, PUBLISH=publish,
        num_warps=num_warps or d_w,
    )
    return True
