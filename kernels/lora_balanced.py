"""lora_balanced: lora_apply's one-slice decode delta with every program's share of the bytes equal.

    y[t] += scale[slot(t)] * (x[t] @ A[slot(t), 0, :r]ᵀ) @ B[slot(t), :, :r]ᵀ    every one-token segment t

The same math and rounding as lora_apply's fused kernel (kernels/lora_apply.py) for one-slice
projections (o_proj, down_proj), scheduled differently. The fused kernel gives each token one
program (its A, then its B); 256 tokens on 132 SMs leave 124 SMs with two programs and 8 with one,
and the kernel takes as long as an SM with two (H200: 264 tokens take no longer than 256,
docs/benchmarks.md round 11). Here a token is a row of U equal units (KA tiles of A, [R, BLOCK_K],
then NB tiles of B, [BLOCK_N, R]: the same bytes when BLOCK_K = BLOCK_N), all tokens' units end to
end, and P programs (more than tokens: a share is shorter than a token, so it touches at most two)
take equal contiguous shares: program q the units [q*W/P, (q+1)*W/P).

A program runs two pipelined loops, as a fused program does (round 12's stream-K, a loop per token
part, lost to the extra loop fills):
- its A units (of up to two tokens), x · A summed per token: a partial h per token;
- its B units (of up to two tokens), adding into y. In that loop's first step (while the copy
  engine fetches its first B tiles) it publishes each partial another program needs (a slot of a
  small fp32 buffer, then its flag, release) and, for each token cut by a share boundary, sums the
  partials of every program holding the token's A units in program order (acquire; the same order,
  so the same bits, whoever sums), then rounds and scales h as lora_expand does.

A program waits only on programs before it (A units precede B units), each of which publishes
before it waits; every wait is bounded (SPIN_LIMIT polls), after which the program computes the
missing partial itself from A (the same products over the same K tiles). The last
program out (a counter) zeroes the flags and the counter, so the buffer is clean for the next launch
(CUDA-graph replays included) without a memset. Rounding differs from the fused kernel's only in how
h's fp32 sum over K is grouped where a token is cut (as lora_shrink's K splits group it).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.platform import interpreter_active

# Polls of a producer's flag before a program computes that partial itself.
SPIN_LIMIT = 20000
# Programs per SM.
PROGRAMS_PER_SM = 2

_WORKSPACE: dict = {}  # device -> (pub fp32, flags int32): partial h slots and their flags


@triton.jit
def _start(q, UTOT, P):
    """First unit of program q's share."""
    return (q * UTOT) // P


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
def _a_partial(x_desc, a_desc, row, a_row0, k_lo, k_hi, r_mask,
               BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """A partial h of one token over A's K tiles k_lo .. k_hi (the way out of a wait: a producer's
    partial from the same products, summed the same way)."""
    acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k in range(k_lo, k_hi):
        xt = x_desc.load([row, k * BLOCK_K])
        at = a_desc.load([a_row0, k * BLOCK_K])
        acc2 += at.to(tl.float32) * xt.to(tl.float32)
    return tl.where(r_mask, tl.sum(acc2, axis=1), 0.0)


@triton.jit
def _token_h(t, q, own, x_desc, a_desc, row, slot, r_mask, pub_ptr, flag_ptr, scale_ptr, KA, U, UTOT, P,
             BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr, SPIN_LIMIT: tl.constexpr,
             R):
    """h of token t (cut by a share boundary), rounded and scaled: the partials of programs p_lo .. p_hi
    (those holding its A units) summed in program order, program q's own from registers."""
    offs_r = tl.arange(0, BLOCK_R)
    a_lo = t * U
    hv = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for p in range(((a_lo + 1) * P - 1) // UTOT, ((a_lo + KA) * P - 1) // UTOT + 1):
        if p == q:
            part = own
        else:
            ps = _start(p, UTOT, P)
            pub = 2 * p + (t != ps // U).to(tl.int32)
            ok = tl.atomic_add(flag_ptr + pub, 0, sem="acquire", scope="gpu")
            spins = 0
            while (ok == 0) & (spins < SPIN_LIMIT):
                ok = tl.atomic_add(flag_ptr + pub, 0, sem="acquire", scope="gpu")
                spins += 1
            if ok != 0:
                part = tl.load(pub_ptr + pub * BLOCK_R + offs_r, cache_modifier=".cg")
            else:  # program p has not published (not started yet): its partial here
                pe = _start(p + 1, UTOT, P)
                part = _a_partial(x_desc, a_desc, row, slot * R, tl.maximum(ps - a_lo, 0),
                                  tl.minimum(pe - a_lo, KA), r_mask, BLOCK_R, BLOCK_K)
        hv += part
    hv = hv.to(a_desc.dtype).to(tl.float32)  # rounded to the weights' dtype, as lora_expand does
    if HAS_SCALE:
        hv = hv * tl.load(scale_ptr + slot)
    return hv


@triton.jit
def _publish(pub_ptr, flag_ptr, idx, part, BLOCK_R: tl.constexpr):
    """A partial into slot idx, then its flag (release: the stores first)."""
    tl.store(pub_ptr + idx * BLOCK_R + tl.arange(0, BLOCK_R), part)
    tl.debug_barrier()  # every thread's stores before the release
    tl.atomic_xchg(flag_ptr + idx, 1, sem="release", scope="gpu")


@triton.jit
def _lora_balanced_kernel(
    x_desc,  # TMA descriptor of x [T, K], blocks [1, BLOCK_K]
    a_desc,  # TMA descriptor of A as [S*R, K], blocks [BLOCK_R, BLOCK_K] (BLOCK_R = R)
    b_desc,  # TMA descriptor of B as [S*OUT, R], blocks [BLOCK_N, BLOCK_R]
    y_ptr, stride_yt,  # [T, OUT] base output, updated in place (pointer loads and stores)
    scale_ptr,  # [S] fp32 (HAS_SCALE only)
    tok_ptr, seg_start_ptr, seg_slot_ptr, rank_ptr,  # one-token segments (kernels/segments.py)
    pub_ptr,  # [2P, BLOCK_R] fp32: program q's partial h of its first (2q) and second (2q+1) token
    flag_ptr,  # [2P + 1] int32, zero at launch (and left zero): the slots' flags, then the done counter
    K, OUT, R, KA, U, UTOT, P,  # KA = A's K tiles, U = KA + B's column tiles, UTOT = tokens * U (< P * U)
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, SPIN_LIMIT: tl.constexpr, PUBLISH: tl.constexpr,
):
    q = tl.program_id(0)
    u0 = _start(q, UTOT, P)
    u1 = _start(q + 1, UTOT, P)
    offs_r = tl.arange(0, BLOCK_R)
    if u1 > u0:
        # the share's tokens: t0 (its first unit's) and t1 (its last unit's; t0 or the next one)
        t0 = u0 // U
        t1 = (u1 - 1) // U
        two = t1 != t0
        row0, slot0, rank0 = _token(t0, seg_start_ptr, seg_slot_ptr, rank_ptr, tok_ptr, GATHER)
        row1, slot1, rank1 = _token(t1, seg_start_ptr, seg_slot_ptr, rank_ptr, tok_ptr, GATHER)
        rm0 = offs_r < rank0
        rm1 = offs_r < rank1
        lo0 = u0 - t0 * U  # token t0's units lo0 .. hi0 are this program's (t1's: 0 .. hi1)
        hi0 = tl.minimum(u1 - t0 * U, U)
        hi1 = u1 - t1 * U
        cut0 = (lo0 > 0) | (hi0 < U)
        cut1 = hi1 < U
        # A units: t0's lo0 .. min(hi0, KA), then t1's 0 .. min(hi1, KA); none for an empty slot
        n0 = tl.where(rank0 > 0, tl.maximum(tl.minimum(hi0, KA) - lo0, 0), 0)
        n1 = tl.where(two & (rank1 > 0), tl.minimum(hi1, KA), 0)
        acc0 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)  # summed over K once, after the loop
        acc1 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for s in tl.range(0, n0 + n1, num_stages=STAGES):
            first = s < n0
            k = tl.where(first, lo0 + s, s - n0)
            xt = x_desc.load([tl.where(first, row0, row1), k * BLOCK_K])  # [1, BLOCK_K]; past K zero-filled
            at = a_desc.load([tl.where(first, slot0, slot1) * R, k * BLOCK_K])  # [BLOCK_R, BLOCK_K]
            prod = at.to(tl.float32) * xt.to(tl.float32)
            acc0 += tl.where(first, prod, 0.0)
            acc1 += tl.where(first, 0.0, prod)
        p0 = tl.where(rm0, tl.sum(acc0, axis=1), 0.0)
        p1 = tl.where(rm1, tl.sum(acc1, axis=1), 0.0)
        # B units: t0's max(lo0, KA) - KA .. hi0 - KA, then t1's 0 .. hi1 - KA
        b0 = tl.maximum(lo0, KA) - KA
        m0 = tl.where(rank0 > 0, tl.maximum(hi0 - KA - b0, 0), 0)
        m1 = tl.where(two & (rank1 > 0), tl.maximum(hi1 - KA, 0), 0)
        pub0 = PUBLISH & cut0 & (n0 > 0)  # partials other programs need
        pub1 = PUBLISH & two & cut1 & (n1 > 0)
        if m0 + m1 == 0:  # no B units here: publish now
            if pub0:
                _publish(pub_ptr, flag_ptr, 2 * q, p0, BLOCK_R)
            if pub1:
                _publish(pub_ptr, flag_ptr, 2 * q + 1, p1, BLOCK_R)
        h0 = tl.zeros((BLOCK_R,), dtype=tl.float32)
        h1 = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for s in tl.range(0, m0 + m1, num_stages=STAGES):
            first = s < m0
            c0 = tl.where(first, b0 + s, s - m0) * BLOCK_N
            bt = b_desc.load([tl.where(first, slot0 * OUT, slot1 * OUT) + c0, 0])  # [BLOCK_N, BLOCK_R]
            if s == 0:
                # while the copy engine fetches the first B tiles: publish, then gather each h
                if pub0:
                    _publish(pub_ptr, flag_ptr, 2 * q, p0, BLOCK_R)
                if pub1:
                    _publish(pub_ptr, flag_ptr, 2 * q + 1, p1, BLOCK_R)
                if m0 > 0:
                    if cut0:
                        h0 = _token_h(t0, q, p0, x_desc, a_desc, row0, slot0, rm0, pub_ptr, flag_ptr, scale_ptr,
                                      KA, U, UTOT, P, BLOCK_R, BLOCK_K, HAS_SCALE, SPIN_LIMIT, R)
                    else:
                        h0 = p0.to(a_desc.dtype).to(tl.float32)
                        if HAS_SCALE:
                            h0 = h0 * tl.load(scale_ptr + slot0)
                if m1 > 0:
                    if cut1:
                        h1 = _token_h(t1, q, p1, x_desc, a_desc, row1, slot1, rm1, pub_ptr, flag_ptr, scale_ptr,
                                      KA, U, UTOT, P, BLOCK_R, BLOCK_K, HAS_SCALE, SPIN_LIMIT, R)
                    else:
                        h1 = p1.to(a_desc.dtype).to(tl.float32)
                        if HAS_SCALE:
                            h1 = h1 * tl.load(scale_ptr + slot1)
            y_row = y_ptr + tl.where(first, row0, row1).to(tl.int64) * stride_yt
            cols = c0 + tl.arange(0, BLOCK_N)[None, :]
            yt = tl.load(y_row + cols, mask=cols < OUT, other=0.0)
            bf = tl.where(tl.where(first, rm0, rm1)[None, :], bt.to(tl.float32), 0.0)  # rank padding: anything
            acc = tl.sum(bf * tl.where(first, h0, h1)[None, :], axis=1)
            tl.store(y_row + cols, (yt.to(tl.float32) + acc[None, :]).to(bt.dtype), mask=cols < OUT)
    # The last program out zeroes the flags and the counter for the next launch: every other program
    # has counted itself out, after its last read of a flag.
    tl.debug_barrier()
    done = tl.atomic_add(flag_ptr + 2 * P, 1, sem="acq_rel", scope="gpu")
    if done == P - 1:
        for i in range(0, 2 * P, 256):
            offs = i + tl.arange(0, 256)
            tl.store(flag_ptr + offs, tl.zeros((256,), dtype=tl.int32), mask=offs < 2 * P)
        tl.atomic_xchg(flag_ptr + 2 * P, 0)


def _workspace(device: torch.device, programs: int) -> Optional[tuple]:
    """The partial-h slots (max rank 64) and flags for `programs` programs on `device` (zeroed once, left
    zero by every launch); None when a larger buffer would have to be allocated during CUDA-graph
    capture (the caller runs the fused kernel instead)."""
    have = _WORKSPACE.get(device)
    if have is not None and have[1].numel() >= 2 * programs + 1:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    slots = max(2 * programs, have[1].numel() - 1 if have is not None else 0)
    _WORKSPACE[device] = (torch.zeros(slots * 64, dtype=torch.float32, device=device),
                          torch.zeros(slots + 1, dtype=torch.int32, device=device))
    return _WORKSPACE[device]


def default_programs(device: torch.device) -> int:
    """PROGRAMS_PER_SM programs an SM (the interpreter: 4)."""
    if device.type != "cuda":
        return 4
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def launch_balanced(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs,
                    slot_ranks: torch.Tensor, scalings: Optional[torch.Tensor], *, programs: Optional[int] = None,
                    block_k: int = 256, num_stages: int = 4, num_warps: int = 4, publish: bool = True) -> bool:
    """Run the balanced kernel for lora_apply (one slice, one-token segments, operands checked by
    lora_apply and its tma_unfit_reason). False when it does not run: more tokens than programs (a
    share would hold more than two tokens), or a workspace that would have to be allocated during
    CUDA-graph capture; the caller runs the fused kernel then.
    programs: P (None = default_programs); block_k: a unit's K step of A and column step of B;
    publish False: no program publishes, every cut token's partials are recomputed by their consumers
    (the way out of a wait, for the tests)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, K = x.shape
    S, n, R, _ = A.shape
    OUT = y.shape[1]
    if n != 1:
        raise ValueError(f"lora_balanced: one slice only, got {n}")
    G = segs.num_segs
    P = programs or default_programs(y.device)
    if G >= P or G == 0:
        return False
    KA = triton.cdiv(K, block_k)
    U = KA + triton.cdiv(OUT, block_k)
    ws = _workspace(y.device, P)
    if ws is None:
        return False
    pub, flags = ws
    tok = segs.token_index if segs.token_index is not None else segs.starts
    _lora_balanced_kernel[(P,)](
        TensorDescriptor.from_tensor(x, [1, block_k]), TensorDescriptor.from_tensor(A.view(S * R, K), [R, block_k]),
        TensorDescriptor.from_tensor(B.view(S * OUT, R), [block_k, R]), y, y.stride(0),
        scalings if scalings is not None else slot_ranks, tok, segs.starts, segs.slots, slot_ranks, pub, flags,
        K, OUT, R, KA, U, G * U, P,
        BLOCK_R=R, BLOCK_K=block_k, BLOCK_N=block_k, STAGES=num_stages, GATHER=segs.token_index is not None,
        HAS_SCALE=scalings is not None, SPIN_LIMIT=0 if interpreter_active() else SPIN_LIMIT, PUBLISH=publish,
        num_warps=num_warps,
    )
    return True
