"""Probe: a ping-pong GEMM in triton's Gluon dialect on Hopper, against cuBLAS (issue 6, round 13).

lora_gemm's Triton GEMM stays 4-6 % behind cuBLAS at 4096-8192 tokens (round 12: a fixed cost a tile,
pipeline fill and epilogue, that cuBLAS hides), and triton 3.6's automatic warp specialization did not
change that (probe_ws_gemm_gpu.py). cuBLAS's Hopper kernels hide the epilogue with a ping-pong schedule:
two consumer warp groups take alternate output tiles from one ring of TMA-loaded operand stages, so
one group's epilogue runs while the other's MMAs do. This writes that schedule by hand in Gluon (no CPU
interpreter: a probe, not a kernel of the package) to learn whether it closes the gap before anyone
builds lora_gemm on it.

Each program is persistent and walks the tiles p, p + P, ...; its local tiles 0, 2, 4, ... go to
consumer 0 (the default partition), 1, 3, 5, ... to consumer 1 (a worker); a 4-warp loader fills the
ring in the order the tiles are consumed. Ring position of K step k of local tile j: j * k_steps + k.
A group starts a tile only once the other has reached its own tile's last K step (a "turn" barrier):
that keeps every stage barrier's waiter at most one phase ahead (parity waits) and is the ping-pong.

The LoRA delta (--delta) goes in the epilogue, under the other group's MMAs: h from lora_shrink's fp32
planes, or with the shrink fused (FUSED_VARIANT): column tile 0 of each row tile also multiplies the x
tile already in shared memory by A's [n*R, 64] tile (loaded beside W's), stores h and raises the row
tile's flag; every tile of the row waits for it (bounded spin) before its delta. One adapter a row tile
in that mode (segments on 128-row boundaries); y is stored from registers there, for A's stages. Two
more forms of the fused shrink: shrink first (column tile 0 streams [x, A] steps through the ring before
its GEMM steps, round 13) and spread over C (round 14: column tiles 0..C-1 each take 1/C of the shrink's
K steps, run them first in a K order rotated to start there, publish a partial plane and raise a count;
the epilogue waits for C and sums the planes in order), and by a fourth warp group (round 14: a partition
of its own with its own ring computes h from the kernel's start, whole row tiles or K splits; an idle
mode times the 16-warp layout alone). All of them lost to the shipped lora_gemm (docs/benchmarks.md).

--compile-only also says when ptxas serializes the kernel's wgmmas (C7515: a non-wgmma instruction
defines accumulator registers while one is in flight). Round 14's first spread form had a second copy of
the plain K loop inside the sharing tiles' branch: serialized, every fused mode ran 2x slower, results
right. One plain loop that every tile runs after the branch fixed it.

    python3 benchmarks/probe_gluon_gemm_gpu.py [--t 4096,8192] [--proj qkv,o,down]
    python3 benchmarks/probe_gluon_gemm_gpu.py --delta [--t 4096,8192] [--proj qkv,o] [--fused-modes NAMES]
        (the LoRA delta in the epilogue, h given and with the fused shrink, against the ping-pong alone,
        lora_gemm and the shipped lora_linear; NAMES from FUSED_MODES, comma-separated, default all)
    PYTHONPATH=.venv/gpu-triton python3 benchmarks/probe_gluon_gemm_gpu.py --compile-only   (sm90, no GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--compile-only" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

# (name, BM, BN, BK, stages, consumer regs, loader regs, maxnreg, y buffers: 2 = one a group, 1 = shared)
VARIANTS = [
    ("pingpong 128x128x64 s5", 128, 128, 64, 5, 232, 40, 168, 2),
    ("pingpong 128x128x64 s6 shared y", 128, 128, 64, 6, 232, 40, 168, 1),
    ("pingpong 128x128x32 s12 shared y", 128, 128, 32, 12, 232, 40, 168, 1),
    ("pingpong 128x128x128 s3 shared y", 128, 128, 128, 3, 232, 40, 168, 1),
]
# --delta: the deepest ring that leaves room for the delta's B tile
DELTA_VARIANT = ("pingpong 128x128x64 s5 shared y", 128, 128, 64, 5, 232, 40, 168, 1)
# the fused shrink: A's tiles take y's room (y stored from registers, under the other group's MMAs)
FUSED_VARIANT = ("pingpong 128x128x64 s5 direct y", 128, 128, 64, 5, 232, 40, 168, 0)


@gluon.jit
def _tile_offsets(j, pid, nprogs, num_m, num_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    tile = pid + j * nprogs
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % size_m
    pid_n = (tile % group) // size_m
    return pid_m * BM, pid_n * BN


@gluon.jit
def _my_tiles(M, N, BM: gl.constexpr, BN: gl.constexpr):
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, BN)
    pid = gl.program_id(0)
    nprogs = gl.num_programs(0)
    count = (num_m * num_n - pid + nprogs - 1) // nprogs
    return pid, nprogs, num_m, num_n, count


_NO_SLOT = gl.constexpr(1 << 30)


@gluon.jit
def _tile_steps(j, pid, nprogs, num_m, num_n, k_steps, tslot_ptr, SHRINK_FIRST: gl.constexpr, BM: gl.constexpr,
                BN: gl.constexpr):
    """Ring positions local tile j takes: its K steps, twice for a shrink-first column tile 0 with an
    adapter (the [x, A] steps of its shrink, then its [x, W] steps)."""
    steps = k_steps
    if SHRINK_FIRST:
        off_m, off_n = _tile_offsets(j, pid, nprogs, num_m, num_n, BM, BN, 8)
        tslot = gl.load(tslot_ptr + off_m // BM)
        if (off_n == 0) & (tslot >= 0):
            steps = 2 * k_steps
    return steps


@gluon.jit
def _delta(acc, b_smem, off_m, off_n, M, N, h_ptr, b_ptr, slots_ptr, o1, o2, stride_h, stride_p, n_parts,
           layout: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """acc += h[rows, slice's R columns] @ B[slot][cols]ᵀ for each distinct slot among the tile's rows
    (h fp32 [P, M, n*16] planes of partial sums, lora_shrink's output, summed here; B bf16 [S, N, 16]):
    one rank-16 wgmma a slot, h from registers, B's tile through b_smem. Runs in the group's epilogue,
    i.e. under the other group's main loop."""
    RP: gl.constexpr = 16
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
    b_layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    sl = (off_n >= o1).to(gl.int32) + (off_n >= o2).to(gl.int32)
    hr = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, a_layout))
    hc = gl.arange(0, RP, layout=gl.SliceLayout(0, a_layout))
    h_ptrs = h_ptr + hr.to(gl.int64)[:, None] * stride_h + sl * RP + hc[None, :]
    hf = gl.zeros([BM, RP], gl.float32, a_layout)
    for p in range(n_parts):
        hf += gl.load(h_ptrs + p * stride_p, mask=(hr < M)[:, None], other=0.0, cache_modifier=".cg")
    h = hf.to(gl.bfloat16)
    h_slots = gl.load(slots_ptr + hr, mask=hr < M, other=-1)
    bn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, b_layout))
    br = gl.arange(0, RP, layout=gl.SliceLayout(0, b_layout))
    b_rows = b_ptr + bn.to(gl.int64)[:, None] * RP + br[None, :]
    cur = gl.min(gl.where(h_slots >= 0, h_slots, _NO_SLOT), axis=0)
    while cur != _NO_SLOT:
        b = gl.load(b_rows + cur.to(gl.int64) * N * RP)
        b_smem.store(b)
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of B in shared memory before the group's wgmma reads it
        hm = gl.where((h_slots == cur)[:, None], h, gl.zeros_like(h))
        acc = warpgroup_mma(hm, b_smem.permute((1, 0)), acc)
        gl.thread_barrier()  # the wgmma has read b_smem before the next slot's B overwrites it
        cur = gl.min(gl.where(h_slots > cur, h_slots, _NO_SLOT), axis=0)
    return acc


@gluon.jit
def _publish_h(hacc, off_m, M, h_ptr, stride_h, flag_ptr, BM: gl.constexpr):
    """A share of h (fp32 [BM, n*R padded], its MMA layout) stored in its plane, then the row tile's
    count of published shares raised."""
    NR: gl.constexpr = hacc.shape[1]
    hrow = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, hacc.type.layout))
    hcol = gl.arange(0, NR, layout=gl.SliceLayout(0, hacc.type.layout))  # padded to a power of 2
    gl.store(h_ptr + hrow[:, None] * stride_h + hcol[None, :], hacc,
             mask=(hrow < M)[:, None] & (hcol < stride_h)[None, :])
    gl.thread_barrier()  # every thread's h stores before the release below
    gl.atomic_add(flag_ptr + off_m // BM, 1, sem="release", scope="gpu")


@gluon.jit
def _share(part, k_steps, num_n, SPREAD: gl.constexpr):
    """K steps [k0, k1) of the shrink that column tile `part` (< SPREAD) of a row tile computes."""
    parts = gl.minimum(num_n, SPREAD)
    return part * k_steps // parts, (part + 1) * k_steps // parts


@gluon.jit
def _plain_steps(acc, x_bufs, w_bufs, ready, empty, turn, c: gl.constexpr, tile_base, i_lo, i_hi, k_steps):
    """The tile's ring positions tile_base + [i_lo, i_hi) (its i-th K step, whichever K index the loader
    put there): one MMA in flight; the previous step's stage, read then, goes back to the loader."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    for i in range(i_lo, i_hi):
        pos = tile_base + i
        s = pos % STAGES
        mbarrier.wait(ready.index(s), (pos // STAGES) & 1)
        mbarrier.arrive(turn.index(1 - c), pred=i == k_steps - 1)
        acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((pos + STAGES - 1) % STAGES), pred=i > 0)
    return acc


@gluon.jit
def _consume(c: gl.constexpr, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_bufs, ready, empty, turn, M, N, K, dargs):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    # y stored from registers (a [2, 16, 16] placeholder for y_bufs): no y buffer, the room goes to stages
    DIRECT_Y: gl.constexpr = y_bufs.type.shape[1] < BM
    # one y buffer for both groups: their epilogues come one after the other (the ping-pong), ordered
    # by turn's third barrier; else one each
    SHARED_Y: gl.constexpr = (y_bufs.type.shape[0] == 1) and not DIRECT_Y
    y_buf = y_bufs.index(0 if SHARED_Y else c)
    pid, nprogs, num_m, num_n, count = _my_tiles(M, N, BM, BN)
    k_steps = gl.cdiv(K, BK)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    b_smems, h_ptr, b_ptr, slots_ptr, o1, o2, stride_h, stride_p, n_parts, a_desc, a_bufs, tslot_ptr, flag_ptr, y_ptr, SPREAD, SHRINK_WG, sx_bufs, sa_bufs, sready = dargs
    # the fused shrink: in the K loop (a_bufs a stage each) or first, through W's stages (a 2-entry marker)
    FUSED: gl.constexpr = a_bufs.type.shape[0] > 1
    SHRINK_FIRST: gl.constexpr = a_bufs.type.shape[0] == 2
    base = 0
    if c == 1:
        base = _tile_steps(0, pid, nprogs, num_m, num_n, k_steps, tslot_ptr, SHRINK_FIRST, BM, BN)
    for j in range(c, count, 2):
        off_m, off_n = _tile_offsets(j, pid, nprogs, num_m, num_n, BM, BN, 8)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        tile_base = base
        base += _tile_steps(j, pid, nprogs, num_m, num_n, k_steps, tslot_ptr, SHRINK_FIRST, BM, BN)
        base += _tile_steps(j + 1, pid, nprogs, num_m, num_n, k_steps, tslot_ptr, SHRINK_FIRST, BM, BN)
        # Wait for the other group to reach its tile's last K step: every ring position before this
        # tile's is loaded then, so a parity wait on a stage's barrier cannot match a phase two behind.
        turn_phase = j // 2 - 1 + c
        mbarrier.wait(turn.index(c), turn_phase & 1, pred=turn_phase >= 0)
        tslot = -1
        if FUSED or SHRINK_WG:
            tslot = gl.load(tslot_ptr + off_m // BM)
        if SHRINK_FIRST and (off_n == 0) and (tslot >= 0):
            # column tile 0 of a row tile with an adapter: h = x @ A[slot]ᵀ first, [x, A] steps through
            # the ring (A's [n*R padded, BK] tile in the first rows of W's stage), published, then the GEMM
            NRP: gl.constexpr = a_desc.block_type.shape[0]
            hs_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, NRP, 16])
            hacc = gl.zeros((BM, NRP), dtype=gl.float32, layout=hs_layout)
            for k in range(k_steps):
                pos = tile_base + k
                s = pos % STAGES
                mbarrier.wait(ready.index(s), (pos // STAGES) & 1)
                hacc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).slice(0, NRP).permute((1, 0)), hacc,
                                     is_async=True)
                hacc = warpgroup_mma_wait(1, deps=(hacc,))
                mbarrier.arrive(empty.index((pos + STAGES - 1) % STAGES), pred=k > 0)
            hacc = warpgroup_mma_wait(0, deps=(hacc,))
            mbarrier.arrive(empty.index((tile_base + k_steps - 1) % STAGES))
            _publish_h(hacc, off_m, M, h_ptr, stride_h, flag_ptr, BM)
            tile_base += k_steps
        i_first = 0
        if (not SHRINK_FIRST) and FUSED and (off_n < SPREAD * BN) and (tslot >= 0):
            # one of column tiles 0..SPREAD-1 of a row tile with an adapter: its share [k0, k1) of the K
            # steps of h = x @ A[slot]ᵀ, from the x tile already in shared memory and A's [n*R, BK] tile
            # the loader put beside it. The tile runs its K steps from k0 round to k0 - 1, so the share
            # comes first and h's partial sum (plane off_n // BN) is published early
            NR: gl.constexpr = a_bufs.type.shape[1]
            h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, NR, 16])
            hacc = gl.zeros((BM, NR), dtype=gl.float32, layout=h_layout)
            part = off_n // BN
            k0, k1 = _share(part, k_steps, num_n, SPREAD)
            for i in range(0, k1 - k0):
                pos = tile_base + i
                s = pos % STAGES
                mbarrier.wait(ready.index(s), (pos // STAGES) & 1)
                mbarrier.arrive(turn.index(1 - c), pred=i == k_steps - 1)
                acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
                hacc = warpgroup_mma(x_bufs.index(s), a_bufs.index(s).permute((1, 0)), hacc, is_async=True)
                acc, hacc = warpgroup_mma_wait(2, deps=(acc, hacc))
                mbarrier.arrive(empty.index((pos + STAGES - 1) % STAGES), pred=i > 0)
            acc, hacc = warpgroup_mma_wait(0, deps=(acc, hacc))
            _publish_h(hacc, off_m, M, h_ptr + part * stride_p, stride_h, flag_ptr, BM)
            i_first = k1 - k0
        # the tile's (remaining) steps: one loop for every tile, as a second copy of it in the branch
        # above makes ptxas serialize every wgmma of the kernel (C7515, 2x slower)
        acc = _plain_steps(acc, x_bufs, w_bufs, ready, empty, turn, c, tile_base, i_first, k_steps, k_steps)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((tile_base + k_steps - 1) % STAGES))
        if SHARED_Y:  # the previous tile's epilogue (the other group's) is done with y_buf and b_smem
            mbarrier.wait(turn.index(2), (j - 1) & 1, pred=j > 0)
        elif not DIRECT_Y:  # this group's previous tile has left y_buf
            tma.store_wait(0)
        if b_smems.type.shape[1] > 1:  # HAS_DELTA: the LoRA delta
            if (FUSED or SHRINK_WG == 1) and (tslot >= 0):  # wait for every share of the row tile's h
                parts = 1
                if FUSED and not SHRINK_FIRST:
                    parts = gl.minimum(num_n, SPREAD)
                if SHRINK_WG == 1:
                    parts = SPREAD
                spins = 0
                while (gl.atomic_add(flag_ptr + off_m // BM, 0, sem="acquire", scope="gpu") < parts) & (spins < 200000):
                    spins += 1
            acc = _delta(acc, b_smems.index(0 if SHARED_Y else c), off_m, off_n, M, N, h_ptr, b_ptr, slots_ptr,
                         o1, o2, stride_h, stride_p, n_parts, layout, BM, BN)
        if DIRECT_Y:
            yr = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
            yc = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            gl.store(y_ptr + yr[:, None] * N + yc[None, :], acc.to(y_desc.dtype),
                     mask=(yr < M)[:, None] & (yc < N)[None, :])
        else:
            y_buf.store(acc.to(y_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(y_desc, [off_m, off_n], y_buf)
        if SHARED_Y:
            tma.store_wait(0)
            mbarrier.arrive(turn.index(2))
    tma.store_wait(0)


@gluon.jit
def _shrink_load(x_desc, a_desc, sx_bufs, sa_bufs, sready, s, off_m, a_row, k_off):
    """The shrink warp group's stage s: x's [BM, BK] tile and A's [n*R padded, BK] tile at column k_off."""
    mbarrier.expect(sready.index(s), x_desc.block_type.nbytes + a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [off_m, k_off], sready.index(s), sx_bufs.index(s))
    tma.async_copy_global_to_shared(a_desc, [a_row, k_off], sready.index(s), sa_bufs.index(s))


@gluon.jit
def _shrinker(x_desc, w_desc, y_desc, x_bufs, w_bufs, y_bufs, ready, empty, turn, M, N, K, dargs):
    """A fourth warp group (SHRINK_WG): h = x @ A[slot]ᵀ from the kernel's start, through a ring of its
    own (its TMA loads SS - 1 steps ahead of its wgmma), in work items pid, pid + P, ...: item w is
    share w % SPREAD of row tile w // SPREAD's K steps (SPREAD = 1: whole row tiles), published in plane
    w % SPREAD with a count on the row tile's flag. The shrink is memory-bound and the GEMM's groups
    compute-bound: it runs beside them on the same SM; split, h is ready sooner."""
    b_smems, h_ptr, b_ptr, slots_ptr, o1, o2, stride_h, stride_p, n_parts, a_desc, a_bufs, tslot_ptr, flag_ptr, y_ptr, SPREAD, SHRINK_WG, sx_bufs, sa_bufs, sready = dargs
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    NRP: gl.constexpr = a_desc.block_type.shape[0]
    SS: gl.constexpr = sx_bufs.type.shape[0]
    h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NRP, 16])
    num_m = gl.cdiv(M, BM)
    k_steps = gl.cdiv(K, BK)
    cnt = 0  # ring position of this row tile's first step
    # SHRINK_WG 2: the partition idles (no shrink, no flags): what the layout itself costs the GEMM
    for w in range(gl.program_id(0), num_m * SPREAD if SHRINK_WG == 1 else 0, gl.num_programs(0)):
        r = w // SPREAD
        part = w % SPREAD
        tslot = gl.load(tslot_ptr + r)
        if tslot >= 0:
            off_m = r * BM
            k0 = part * k_steps // SPREAD
            n_k = (part + 1) * k_steps // SPREAD - k0
            for i in gl.static_range(SS - 1):
                if i < n_k:
                    _shrink_load(x_desc, a_desc, sx_bufs, sa_bufs, sready, (cnt + i) % SS, off_m, tslot * stride_h,
                                 (k0 + i) * BK)
            hacc = gl.zeros((BM, NRP), dtype=gl.float32, layout=h_layout)
            for k in range(n_k):
                # the stage of step k + SS - 1 is step k - 1's, whose wgmma has completed
                kn = k + SS - 1
                if kn < n_k:
                    _shrink_load(x_desc, a_desc, sx_bufs, sa_bufs, sready, (cnt + kn) % SS, off_m, tslot * stride_h,
                                 (k0 + kn) * BK)
                pos = cnt + k
                s = pos % SS
                mbarrier.wait(sready.index(s), (pos // SS) & 1)
                hacc = warpgroup_mma(sx_bufs.index(s), sa_bufs.index(s).permute((1, 0)), hacc, is_async=True)
                hacc = warpgroup_mma_wait(0, deps=(hacc,))
            cnt += n_k
            _publish_h(hacc, off_m, M, h_ptr + part * stride_p, stride_h, flag_ptr, BM)


@gluon.jit
def _consumer0(x_desc, w_desc, y_desc, x_bufs, w_bufs, y_bufs, ready, empty, turn, M, N, K, dargs):
    _consume(0, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_bufs, ready, empty, turn, M, N, K, dargs)


@gluon.jit
def _consumer1(x_desc, w_desc, y_desc, x_bufs, w_bufs, y_bufs, ready, empty, turn, M, N, K, dargs):
    _consume(1, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_bufs, ready, empty, turn, M, N, K, dargs)


@gluon.jit
def _loader(x_desc, w_desc, y_desc, x_bufs, w_bufs, y_bufs, ready, empty, turn, M, N, K, dargs):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    pid, nprogs, num_m, num_n, count = _my_tiles(M, N, BM, BN)
    k_steps = gl.cdiv(K, BK)
    b_smems, h_ptr, b_ptr, slots_ptr, o1, o2, stride_h, stride_p, n_parts, a_desc, a_bufs, tslot_ptr, flag_ptr, y_ptr, SPREAD, SHRINK_WG, sx_bufs, sa_bufs, sready = dargs
    FUSED: gl.constexpr = a_bufs.type.shape[0] > 1
    SHRINK_FIRST: gl.constexpr = a_bufs.type.shape[0] == 2
    NRP: gl.constexpr = a_desc.block_type.shape[0]
    pos = 0
    for j in range(count):
        off_m, off_n = _tile_offsets(j, pid, nprogs, num_m, num_n, BM, BN, 8)
        do_a = False
        tslot = 0
        k0 = 0
        k1 = 0  # the K steps [k0, k1) that load A's tile beside x and W (the shrink in the K loop)
        if FUSED:
            tslot = gl.load(tslot_ptr + off_m // BM)
            if SHRINK_FIRST:
                do_a = (off_n == 0) & (tslot >= 0)
            else:
                do_a = (off_n < SPREAD * BN) & (tslot >= 0)
                if do_a:
                    k0, k1 = _share(off_n // BN, k_steps, num_n, SPREAD)
        if SHRINK_FIRST and do_a:
            # the shrink's steps first: x and A's tile (in the first NRP rows of W's stage buffer)
            for k in range(k_steps):
                s = pos % STAGES
                mbarrier.wait(empty.index(s), ((pos // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + a_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [off_m, k * BK], ready.index(s), x_bufs.index(s))
                tma.async_copy_global_to_shared(a_desc, [tslot * stride_h, k * BK], ready.index(s),
                                                w_bufs.index(s).slice(0, NRP))
                pos += 1
        for i in range(k_steps):
            # the tile's i-th step: K step k0 + i round the K loop (k0 = 0 unless it takes a share of the
            # shrink, whose steps come first)
            k = (k0 + i) % k_steps
            s = pos % STAGES
            # barriers start with phase 1 complete: the first pass over the ring does not wait
            mbarrier.wait(empty.index(s), ((pos // STAGES) & 1) ^ 1)
            in_loop_a = do_a & (i < k1 - k0)
            if in_loop_a:
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes
                                + a_desc.block_type.nbytes)
            else:
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, k * BK], ready.index(s), x_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [off_n, k * BK], ready.index(s), w_bufs.index(s))
            if FUSED and not SHRINK_FIRST:
                tma.async_copy_global_to_shared(a_desc, [tslot * stride_h, k * BK], ready.index(s), a_bufs.index(s),
                                                pred=in_loop_a)
            pos += 1


@gluon.jit
def _pingpong_kernel(x_desc, w_desc, y_desc, M, N, K, h_ptr, b_ptr, slots_ptr, o1, o2, stride_h, stride_p, n_parts,
                     a_desc, tslot_ptr, flag_ptr, y_ptr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr, Y_BUFS: gl.constexpr, HAS_DELTA: gl.constexpr,
                     FUSED: gl.constexpr, SHRINK_FIRST: gl.constexpr, SPREAD: gl.constexpr,
                     SHRINK_WG: gl.constexpr, SHRINK_REGS: gl.constexpr):
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    if Y_BUFS == 0:  # y from registers: a placeholder
        y_bufs = gl.allocate_shared_memory(y_desc.dtype, [2, 16, 16], gl.NVMMASharedLayout.get_default_for([16, 16], y_desc.dtype))
    else:
        y_bufs = gl.allocate_shared_memory(y_desc.dtype, [Y_BUFS, BM, BN], y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(3):
        mbarrier.init(turn.index(i), count=1)
    # without the delta a [.., 1, 16] placeholder (never touched): the partitions take one argument list;
    # one B tile buffer when the groups share y (their epilogues are ordered), else one each
    b_smems = gl.allocate_shared_memory(w_desc.dtype, [1 if Y_BUFS == 1 else 2, BN if HAS_DELTA else 1, 16],
                                        gl.NVMMASharedLayout.get_default_for([BN, 16], w_desc.dtype))
    # the fused shrink's A tiles, a stage each (a one-entry placeholder without it)
    # (the shrink-first variant keeps A's tiles in W's stages: a 2-entry [16, 16] marker)
    if SHRINK_FIRST:
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2, 16, 16], gl.NVMMASharedLayout.get_default_for([16, 16], a_desc.dtype))
    elif FUSED:
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    else:  # a 1-entry [16, 16] placeholder
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [1, 16, 16], gl.NVMMASharedLayout.get_default_for([16, 16], a_desc.dtype))
    # the shrink warp group's ring (SHRINK_WG): 2 stages (what shared memory has left) of x's and A's tiles; else 1-entry placeholders
    SS: gl.constexpr = 2 if SHRINK_WG else 1
    sx_bufs = gl.allocate_shared_memory(x_desc.dtype, [SS, BM if SHRINK_WG else 16, BK if SHRINK_WG else 16],
                                        x_desc.layout if SHRINK_WG else gl.NVMMASharedLayout.get_default_for([16, 16], x_desc.dtype))
    sa_bufs = gl.allocate_shared_memory(a_desc.dtype, [SS] + a_desc.block_type.shape, a_desc.layout)
    sready = gl.allocate_shared_memory(gl.int64, [SS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SS):
        mbarrier.init(sready.index(i), count=1)
    dargs = (b_smems, h_ptr, b_ptr, slots_ptr, o1, o2, stride_h, stride_p, n_parts, a_desc, a_bufs, tslot_ptr, flag_ptr,
             y_ptr, SPREAD, SHRINK_WG, sx_bufs, sa_bufs, sready)
    args = (x_desc, w_desc, y_desc, x_bufs, w_bufs, y_bufs, ready, empty, turn, M, N, K, dargs)
    if SHRINK_WG:
        gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args), (_shrinker, args)], [4, 4, 4],
                           [CONSUMER_REGS, LOADER_REGS, SHRINK_REGS])
    else:
        gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args)], [4, 4],
                           [CONSUMER_REGS, LOADER_REGS])


def launch(x, w, y, v, sms: int = 132, delta=None, fused=None, shrink_first=False, spread=1, shrink_wg=0):
    """y = x @ wᵀ, + the delta given h (delta: h fp32 [(P,) M, n, 16] from lora_shrink, B bf16 [S, N, 16], row
    slots int32 [M], o1, o2), or + the delta with the shrink fused (fused: A bf16 [S, n, 16, K], the row
    tiles' slot int32 [cdiv(M, BM)] (one a row tile, -1 = none), row slots, B, o1, o2). The fused shrink's
    form (FUSED_MODES): column tile 0 in its K loop (default), shrink_first, spread over column tiles
    0..spread-1, or shrink_wg 1 (a fourth warp group, in `spread` K splits) / 2 (that group idle)."""
    _, BM, BN, BK, stages, creg, lreg, maxnreg, ybufs = v
    if shrink_wg:
        creg, lreg = WG_REGS[0], WG_REGS[1]
    M, K = x.shape
    N = w.shape[0]
    gdt = gl.bfloat16
    dummy = torch.empty(1, dtype=torch.int32, device=x.device)
    tslots = flags = dummy
    a_t = torch.zeros(16, BK, dtype=x.dtype, device=x.device)  # placeholder without the fused shrink
    if fused is not None:
        A, tslots, slots, B, o1, o2 = fused
        S, n, R, _ = A.shape
        a_t = A.view(S * n * R, K)
        # written by column tiles 0..spread-1 (shares of K; shrink first: column tile 0)
        parts = 1 if shrink_first else (spread if shrink_wg else min(spread, triton.cdiv(N, BN)))
        h = torch.empty(parts, M, n * R, dtype=torch.float32, device=x.device)
        flags = torch.zeros(triton.cdiv(M, BM), dtype=torch.int32, device=x.device)
    elif delta is not None:
        h, B, slots, o1, o2 = delta
        h = h if h.dim() == 4 else h.unsqueeze(0)
        h = h.view(h.shape[0], M, -1)
    else:  # pointers never read
        h, B, slots, o1, o2 = x.view(1, M, K), x, dummy, N, N
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gdt))
    w_desc = TensorDescriptor.from_tensor(w, [BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK], gdt))
    y_desc = TensorDescriptor.from_tensor(y, [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN], gdt))
    a_box = [16 if fused is None else triton.next_power_of_2(A.shape[1] * A.shape[2]), BK]
    a_desc = TensorDescriptor.from_tensor(a_t, a_box, gl.NVMMASharedLayout.get_default_for(a_box, gdt))
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    return _pingpong_kernel[(min(sms, tiles),)](x_desc, w_desc, y_desc, M, N, K, h, B, slots, o1, o2, h.stride(1),
                                                 h.stride(0), h.shape[0], a_desc, tslots, flags, y, BM, BN, BK, stages, 8,
                                                 creg, lreg, ybufs, delta is not None or fused is not None,
                                                 fused is not None and not shrink_wg,
                                                 fused is not None and shrink_first, spread, shrink_wg, WG_REGS[2],
                                                 num_warps=4, maxnreg=WG_REGS[3] if shrink_wg else maxnreg)


def compile_only() -> None:
    """Each variant (and the delta and fused-shrink ones) compiled for sm90 through launch's own
    arguments, CPU tensors (nothing runs): shared memory, register reallocation, wgmma count."""
    from sm90_compile_check import _has_driver, _Sm90Driver, ptxas_info  # the CI check's compile-only sm90 driver
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Sm90Driver(driver.active if _has_driver() else None))
    run = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **kw: run(self, *a, grid=grid, warmup=True, **kw)
    T, K = 512, 4096
    # (name, variant, None / "delta" / a FUSED_MODES name, n slices: 3 = qkv, 1 = o)
    compiled_modes = ("in the K loop", "first", "spread over 8", "by a fourth warp group in 4 K splits")
    for name, v, mode, n in ([(v[0], v, None, 1) for v in VARIANTS]
                             + [(DELTA_VARIANT[0] + " + delta", DELTA_VARIANT, "delta", 3),
                                (FUSED_VARIANT[0] + " + delta", FUSED_VARIANT, "delta", 3)]
                             + [(f"{FUSED_VARIANT[0]} + shrink {m}, {proj}", FUSED_VARIANT, m, n)
                                for m in compiled_modes for proj, n in (("qkv", 3), ("o", 1))]):
        N = 1024
        x, w, y = (torch.empty(*sh, dtype=torch.bfloat16) for sh in ((T, K), (N, K), (T, N)))
        B = torch.empty(4, N, 16, dtype=torch.bfloat16)
        slots = torch.empty(T, dtype=torch.int32)
        try:
            if mode == "delta":
                k = launch(x, w, y, v, delta=(torch.empty(T, n, 16), B, slots, 512, 768))
            elif mode is not None:
                k = launch(x, w, y, v, fused=(torch.empty(4, n, 16, K, dtype=torch.bfloat16),
                                              torch.empty(T // v[1], dtype=torch.int32), slots, B, 512, 768),
                           **FUSED_MODES[mode])
            else:
                k = launch(x, w, y, v)
            info = ptxas_info(k.asm["ptx"]) or ""
            spills = [ln.strip() for ln in info.splitlines() if "spill" in ln]
            serial = "; WGMMA SERIALIZED (ptxas C7515)" if "C7515" in info else ""
            print(f"{name:48s} compiled: smem {k.metadata.shared} B, setmaxnreg {k.asm['ptx'].count('setmaxnreg')}, "
                  f"wgmma {k.asm['ptx'].count('wgmma.mma_async')}; {spills[0] if spills else ''}{serial}")
        except Exception as e:  # noqa: BLE001 - report and go on
            err, msgs = e, []
            while err is not None:
                msgs.append(str(err).strip().splitlines()[-1][:300] if str(err).strip() else type(err).__name__)
                err = err.__cause__ or err.__context__
            print(f"{name:48s} FAILED: {' <- '.join(msgs)}")


# the shrink warp group's mode: 16 warps share the register file (65536 / 512 = 128 each at launch)
# (consumers, loader, shrinker, launch maxnreg): 2 * 192 + 24 + 104 = 512; the sm90 compile spills nothing
# for qkv and o (184 / 40 / 64 spilled 612 bytes for qkv: h's [128, 64] accumulator and its store)
WG_REGS = tuple(int(r) for r in os.environ.get("PROBE_WG_REGS", "192,24,104,128").split(","))

# the fused shrink's forms: name -> launch's keywords. Column tile 0 in its K loop and before its GEMM
# (round 13); the K steps shared by column tiles 0..spread-1, and a fourth warp group (round 14)
FUSED_MODES = {
    "in the K loop": {},
    "first": {"shrink_first": True},
    "spread over 4": {"spread": 4},
    "spread over 8": {"spread": 8},
    "by a fourth warp group": {"shrink_wg": 1},
    "by a fourth warp group in 4 K splits": {"shrink_wg": 1, "spread": 4},
    "by a fourth warp group in 8 K splits": {"shrink_wg": 1, "spread": 8},
    "none (a fourth warp group idle; h not computed: timing only)": {"shrink_wg": 2},
}


def bench(args) -> None:
    """The ping-pong GEMM alone (every VARIANT, its output checked against fp32 torch first) against
    cuBLAS, interleaved CUDA graphs (medians of --reps), per projection and T."""
    from bench_kernels_gpu import DEV, LLAMA_8B, interleaved_times

    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    print(f"{torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for proj in args.proj.split(","):
        K, slices = LLAMA_8B[proj]
        w = torch.randn(sum(slices), K, device=DEV, dtype=torch.bfloat16) * 0.02
        for T in [int(t) for t in args.t.split(",")]:
            x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16) * 0.1
            want = x.float() @ w.float().t()
            ys = {v[0]: torch.full((T, w.shape[0]), float("nan"), device=DEV, dtype=torch.bfloat16) for v in VARIANTS}
            for v in VARIANTS:
                launch(x, w, ys[v[0]], v, sms)
                torch.cuda.synchronize()
                err = (ys[v[0]].float() - want).abs().max().item()
                ok = err <= 2e-2 * want.abs().max().item()
                print(f"{proj} {T} {v[0]}: max |diff| against fp32 torch {err:.3g} ({'ok' if ok else 'WRONG'})",
                      flush=True)
            fns = {"cuBLAS": lambda: torch.mm(x, w.t()),
                   **{v[0]: (lambda v=v: launch(x, w, ys[v[0]], v, sms)) for v in VARIANTS}}
            t = dict(zip(fns, interleaved_times(list(fns.values()), reps=args.reps)))
            rows += [(proj, T, k, val * 1e6, 100 * (val - t["cuBLAS"]) / t["cuBLAS"]) for k, val in t.items()]
    print("\n| proj | T | kernel | us | vs cuBLAS |\n|---|---|---|---|---|")
    for proj, T, k, us, pct in rows:
        print(f"| {proj} | {T} | {k} | {us:.1f} | {pct:+.1f} % |")


def delta_bench(args) -> None:
    """The ping-pong GEMM with the LoRA delta in its epilogue, h from lora_shrink (fp32 planes), against
    cuBLAS, the ping-pong alone and lora_gemm (no adapter row / h given), and the whole paths: lora_shrink
    then the ping-pong, against the shipped lora_linear (lora_gemm with its fused shrink). One adapter on
    every row, and four adapters plus base rows in segments that cut row tiles."""
    from bench_kernels_gpu import DEV, LLAMA_8B, interleaved_times, offsets
    from kernels.lora_gemm import lora_gemm
    from kernels.lora_linear import lora_linear
    from kernels.lora_shrink import lora_shrink
    from kernels.segments import sgmv_segments

    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    print(f"{torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, triton {triton.__version__}")
    v, rows = DELTA_VARIANT, []
    modes = [m for m in FUSED_MODES if args.fused_modes == "all" or m in args.fused_modes.split(",")]
    for proj in args.proj.split(","):
        K, slices = LLAMA_8B[proj]
        N, n = sum(slices), len(slices)
        offs = offsets(slices)
        o1, o2 = (offs[1] if n > 1 else N), (offs[2] if n > 2 else N)
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.02
        A = torch.randn(4, n, 16, K, device=DEV, dtype=torch.bfloat16) * 0.02
        B = torch.randn(4, N, 16, device=DEV, dtype=torch.bfloat16) * 0.02
        ranks = torch.full((4,), 16, dtype=torch.int32, device=DEV)
        for T in [int(t) for t in args.t.split(",")]:
            x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16) * 0.1
            f = T // 4096
            # the second layout's segments end on row-tile (128) boundaries: the probe's fused shrink takes
            # one slot a row tile (a row tile of two adapters would need a second A tile per K step)
            for layout_name, lens, seg_slots in (("1 adapter", [4096] * f, [0] * f),
                                                 ("4 adapters + base", [1024 * f, 512 * f, 1280 * f, 1280 * f],
                                                  [0, -1, 2, 1])):
                segs = sgmv_segments(lens, seg_slots, DEV)
                rs = torch.nn.functional.pad(segs.row_slots, (0, (-T) % 128), value=-1).view(-1, 128)
                tslots = rs.max(dim=1).values.to(torch.int32).contiguous()
                assert bool(((rs == tslots[:, None]) | (rs < 0)).all()), "a row tile with two adapters"
                fused = (A, tslots, segs.row_slots, B, o1, o2)
                yf = torch.full((T, N), float("nan"), device=DEV, dtype=torch.bfloat16)
                h = lora_shrink(x, A, segs, ranks)
                want = lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton").float()
                y = torch.full((T, N), float("nan"), device=DEV, dtype=torch.bfloat16)
                delta = (h, B, segs.row_slots, o1, o2)
                launch(x, w, y, v, sms, delta)
                torch.cuda.synchronize()
                err = (y.float() - want).abs().max().item()
                ok = err <= 2e-2 * want.abs().max().item()
                print(f"{proj} {T} {layout_name}: ping-pong + delta against the shipped lora_linear: max |diff| "
                      f"{err:.3g} ({'ok' if ok else 'WRONG'})", flush=True)
                for mode_name in modes:
                    yf.fill_(float("nan"))
                    launch(x, w, yf, FUSED_VARIANT, sms, fused=fused, **FUSED_MODES[mode_name])
                    torch.cuda.synchronize()
                    err = (yf.float() - want).abs().max().item()
                    ok = err <= 2e-2 * want.abs().max().item()
                    print(f"{proj} {T} {layout_name}: ping-pong with the shrink {mode_name} "
                          f"against the shipped lora_linear: max |diff| {err:.3g} of max |y| "
                          f"{want.abs().max().item():.3g} ({'ok' if ok else 'WRONG'})", flush=True)
                base_rows = torch.full((T,), -1, dtype=torch.int32, device=DEV)

                def shrink_then_pingpong():
                    hh = lora_shrink(x, A, segs, ranks)
                    launch(x, w, y, v, sms, (hh, B, segs.row_slots, o1, o2))

                fns = {"cuBLAS": lambda: torch.mm(x, w.t()),
                       "ping-pong alone": lambda: launch(x, w, y, v, sms),
                       "ping-pong + delta, h given": lambda: launch(x, w, y, v, sms, delta),
                       "lora_gemm, no adapter row": lambda: lora_gemm(x, w, h, B, base_rows, ranks, offs),
                       "lora_gemm + delta, h given": lambda: lora_gemm(x, w, h, B, segs.row_slots, ranks, offs),
                       "lora_shrink alone": lambda: lora_shrink(x, A, segs, ranks),
                       "lora_shrink + ping-pong with delta": shrink_then_pingpong,
                       **{f"ping-pong, shrink {mode_name} + delta (y from registers)":
                          (lambda kw=FUSED_MODES[mode_name]: launch(x, w, yf, FUSED_VARIANT, sms, fused=fused, **kw))
                          for mode_name in modes},
                       "shipped lora_linear (lora_gemm, fused shrink)":
                           lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton"),
                       "cuBLAS again": lambda: torch.mm(x, w.t())}
                t = dict(zip(fns, interleaved_times(list(fns.values()), reps=args.reps)))
                c = t["cuBLAS"]
                rows.append((proj, T, layout_name, {k: (val * 1e6, 100 * (val - c) / c) for k, val in t.items()}))
                print(f"{proj} {T} {layout_name}: " + " | ".join(f"{k} {val * 1e6:.1f} ({100 * (val - c) / c:+.1f} %)"
                                                                for k, val in t.items()), flush=True)
    keys = list(rows[0][3]) if rows else []
    print("\n| proj | T | layout | cuBLAS µs | " + " | ".join(keys[1:]) + " |")
    print("|---|---|---|---|" + "---|" * (len(keys) - 1))
    for proj, T, name, t in rows:
        print(f"| {proj} | {T} | {name} | {t['cuBLAS'][0]:.1f} | " + " | ".join(
            f"{t[k][0]:.1f} ({t[k][1]:+.1f} %)" for k in keys[1:]) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--delta", action="store_true", help="the ping-pong with the LoRA delta in its epilogue (h given, and the fused shrink modes)")
    ap.add_argument("--t", default="4096,8192")
    ap.add_argument("--fused-modes", default="all", help="--delta: the fused shrink's modes to run (names, comma-separated)")
    ap.add_argument("--proj", default="qkv,o,down")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
    elif args.delta:
        delta_bench(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
