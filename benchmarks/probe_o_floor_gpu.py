"""Probe: how fast can a decode step's adapter bytes be read at all, and does the fused kernel's A -> B
turn cost anything? (issue 6: o_proj at 256 tokens / 256 adapters sits at 53-58 % of copy bandwidth).

Times, interleaved (one CUDA graph per variant, round robin, medians; bench_kernels_gpu's Proj, so the
same buffers), for each Llama-3.1-8B projection at T tokens on D adapters:

- "fused": lora_apply's shipped kernel (the TMA body on sm90+).
- "one loop": the same program (token, slice, columns) as ONE pipelined loop over its A tiles then its B
  tiles: each step loads an A and a B tile through the copy engine, one of them out of bounds (zero
  filled by the copy engine, no memory traffic), so the loads of the first B tiles are already in
  flight while the last A tiles are summed, where the shipped body drains its queue between the two
  loops. Checked against "fused" (same sums in the same order: bits equal).
- "floor grid": the fused kernel's grid and loads (A slice then the program's B columns, TMA, same
  stages), no metadata, no math but a sum: the floor of that access pattern.
- "ladder ...": the fused body (one-slice projections) with its parts switched on one at a time:
  loads only (= floor grid), + the segment metadata, + x and the math, + y's load and store.
- "floor flat": one program an SM x WAVES streaming A and B as flat [rows, 256] tiles: the floor of
  reading those bytes with ideal tiles.
A read of 256 MB runs before every timed replay (not timed; bench_kernels_gpu.interleaved_times), so no
variant pays for another's dirty L2 lines.
- "torch sum" / "torch copy": one torch sum over a buffer of the adapter bytes; a device copy moving
  that many bytes (half read, half written): what a plain read / copy of this size reaches with its
  own launch, ramp and tail.

    python3 benchmarks/probe_o_floor_gpu.py [--shapes 256x256,128x128] [--proj o,qkv] [--b2b 8] [--stages 3,4] [--only REGEX]
    TRITON_INTERPRET=1 python3 benchmarks/probe_o_floor_gpu.py --smoke     # CPU: the kernels' bits only
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import bench_kernels_gpu as bk  # noqa: E402
from kernels.lora_apply import TMA_TILES, _auto_cols_per_prog, _fused_program, lora_apply  # noqa: E402
from kernels.lora_gemm import block_n_for  # noqa: E402
from kernels.segment_tile import segment_row  # noqa: E402


@triton.jit
def _one_loop_kernel(
    y_desc, x_desc, a_desc, b_desc,  # as kernels/lora_apply.py's _lora_fused_tma_kernel
    scale_ptr, tok_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, rank_ptr,
    T, K, OUT, R, NR, o1, o2, cols_per_prog, a_oob, b_oob,  # a_oob / b_oob: A's / B's first row out of bounds
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    seg, m0, slot, rank, i, c_lo, c_hi = _fused_program(seg_len_ptr, seg_slot_ptr, rank_ptr, OUT, o1, o2,
                                                       cols_per_prog)
    if (c_lo >= c_hi) | (rank == 0):
        return
    row = segment_row(seg_start_ptr, tok_ptr, seg, m0, GATHER).to(tl.int32)
    r_mask = tl.arange(0, BLOCK_R) < rank
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + slot)
    NK = tl.cdiv(K, BLOCK_K)
    NB = tl.cdiv(c_hi - c_lo, BLOCK_N)
    acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for it in tl.range(0, NK + NB, num_stages=STAGES):
        in_a = it < NK
        kk = tl.where(in_a, it, 0) * BLOCK_K
        xt = x_desc.load([tl.where(in_a, row, T), kk])  # out of bounds in the B steps: zeros, no traffic
        at = a_desc.load([tl.where(in_a, slot * NR + i * R, a_oob), kk])
        acc2 += at.to(tl.float32) * xt.to(tl.float32)
        hv = tl.where(r_mask, tl.sum(acc2, axis=1), 0.0)
        hv = hv.to(y_desc.dtype).to(tl.float32) * scale
        c0 = c_lo + tl.maximum(it - NK, 0) * BLOCK_N
        y_row = tl.where(in_a, T, row)  # out of bounds in the A steps: loads zeros, the store is dropped
        bt = b_desc.load([tl.where(in_a, b_oob, slot * OUT + c0), 0])
        yt = y_desc.load([y_row, c0])
        bt = tl.where(r_mask[None, :], bt.to(tl.float32), 0.0)
        acc = tl.sum(bt * hv[None, :], axis=1)
        y_desc.store([y_row, c0], (yt.to(tl.float32) + acc[None, :]).to(y_desc.dtype))


@triton.jit
def _floor_grid_kernel(out_ptr, a_desc, b_desc, K, OUT, NR, R, cols_per_prog,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    t = tl.program_id(0)  # token = slot
    i = tl.program_id(1)
    c_lo = tl.program_id(2) * cols_per_prog
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        acc += a_desc.load([t * NR + i * R, k * BLOCK_K]).to(tl.float32)
    accb = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for c0 in tl.range(c_lo, tl.minimum(c_lo + cols_per_prog, OUT), BLOCK_N, num_stages=STAGES):
        accb += b_desc.load([t * OUT + c0, 0]).to(tl.float32)
    pid = (t * tl.num_programs(1) + i) * tl.num_programs(2) + tl.program_id(2)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0) + tl.sum(tl.sum(accb, axis=1), axis=0))


@triton.jit
def bulk_prefetch_l2(ptr, nbytes):
    """cp.async.bulk.prefetch.L2 of nbytes (a multiple of 16) from ptr (16-byte aligned): one instruction
    the copy engine serves in the background, issued by thread 0 only (sm90+, inline PTX)."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\t.reg .b32 t;\n\tmov.u32 t, %tid.x;\n\tsetp.eq.u32 p, t, 0;\n\t"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ladder_kernel(
    y_desc, x_desc, a_desc, b_desc, y_ptr, b_ptr, out_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, rank_ptr,
    K, OUT, R, NR, cols_per_prog,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    META: tl.constexpr, MATH: tl.constexpr, YIO: tl.constexpr, PF: tl.constexpr,
):
    """The fused TMA body (one slice) with its parts switched on one at a time: META = slot, rank and
    row through the segment arrays (else the program's token is its slot and row, rank R); MATH = x
    loaded, h = A x, B h (else A and B only summed); YIO = y tiles loaded, added to and stored (else
    one float a program stored at the end); YIO 2: y through pointer loads and stores; YIO 3: the
    delta rounded to y's dtype and added by the L2 (tl.atomic_add, relaxed: no load of y, one more
    rounding than the shipped body)."""
    if META == 1:
        seg, m0, slot, rank, i, c_lo, c_hi = _fused_program(seg_len_ptr, seg_slot_ptr, rank_ptr, OUT, OUT, OUT,
                                                           cols_per_prog)
        if (c_lo >= c_hi) | (rank == 0):
            return
        row = segment_row(seg_start_ptr, seg_start_ptr, seg, m0, False).to(tl.int32)
    elif META >= 2:  # slot and row loaded side by side; 2: the rank before the branch, 3: after A's loop
        seg = tl.program_id(0)
        slot = tl.load(seg_slot_ptr + seg)
        row = tl.load(seg_start_ptr + seg)
        rank = tl.load(rank_ptr + tl.maximum(slot, 0))
        c_lo = tl.program_id(2) * cols_per_prog
        c_hi = tl.minimum(c_lo + cols_per_prog, OUT)
        if META == 2:
            if (slot < 0) | (rank == 0):
                return
        else:
            if slot < 0:
                return
    else:
        slot = tl.program_id(0)
        row = slot
        rank = R
        c_lo = tl.program_id(2) * cols_per_prog
        c_hi = tl.minimum(c_lo + cols_per_prog, OUT)
    r_mask = tl.arange(0, BLOCK_R) < rank
    if PF > 0:  # the program's first PF columns of B into L2 (one bulk prefetch, thread 0), before A's loop
        nbytes = (tl.minimum(c_hi - c_lo, PF) * R * 2).to(tl.int32)
        bulk_prefetch_l2(b_ptr + (slot.to(tl.int64) * OUT + c_lo) * R, nbytes)
    acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        at = a_desc.load([slot * NR, k * BLOCK_K])
        if MATH:
            xt = x_desc.load([row, k * BLOCK_K])
            acc2 += at.to(tl.float32) * xt.to(tl.float32)
        else:
            acc2 += at.to(tl.float32)
    if META == 3:
        if rank == 0:
            return
    hv = tl.where(r_mask, tl.sum(acc2, axis=1), 0.0)
    hv = hv.to(y_desc.dtype).to(tl.float32)
    tot = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    for c0 in tl.range(c_lo, c_hi, BLOCK_N, num_stages=STAGES):
        bt = b_desc.load([slot * OUT + c0, 0])
        if MATH:
            bt = tl.where(r_mask[None, :], bt.to(tl.float32), 0.0)
            acc = tl.sum(bt * hv[None, :], axis=1)[None, :]
        else:
            acc = tl.sum(bt.to(tl.float32), axis=1)[None, :]
        if YIO == 1:
            yt = y_desc.load([row, c0])
            y_desc.store([row, c0], (yt.to(tl.float32) + acc).to(y_desc.dtype))
        elif YIO == 2:
            yp = y_ptr + row.to(tl.int64) * OUT + c0 + tl.arange(0, BLOCK_N)[None, :]
            yt = tl.load(yp)
            tl.store(yp, (yt.to(tl.float32) + acc).to(y_ptr.dtype.element_ty))
        elif YIO == 4:  # loaded through the copy engine (pipelined), stored through pointers (no smem staging)
            yt = y_desc.load([row, c0])
            yp = y_ptr + row.to(tl.int64) * OUT + c0 + tl.arange(0, BLOCK_N)[None, :]
            tl.store(yp, (yt.to(tl.float32) + acc).to(y_ptr.dtype.element_ty))
        elif YIO == 3:
            yp = y_ptr + row.to(tl.int64) * OUT + c0 + tl.arange(0, BLOCK_N)[None, :]
            tl.atomic_add(yp, acc.to(y_ptr.dtype.element_ty), sem="relaxed")
        else:
            tot += acc
    if YIO == 0:
        pid = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        tl.store(out_ptr + pid, tl.sum(tl.sum(tot, axis=1), axis=0) + tl.sum(hv, axis=0))


LADDER = {  # name -> ladder_fn's switches
    "loads": dict(meta=False, math=False, yio=0),
    "meta": dict(meta=True, math=False, yio=0),
    "meta+math": dict(meta=True, math=True, yio=0),
    "meta+math+y": dict(meta=True, math=True, yio=1),
    "math+y": dict(meta=False, math=True, yio=1),
    "full, y ptr": dict(meta=True, math=True, yio=2),
    "full, y atomic": dict(meta=True, math=True, yio=3),
    "full, y tma load ptr store": dict(meta=True, math=True, yio=4),
    "full, y tma load ptr store, 6 stages": dict(meta=True, math=True, yio=4, stages=6),
    "full, prefetch 768 cols of B": dict(meta=True, math=True, yio=1, pf=768),
    "full, prefetch 2048 cols of B": dict(meta=True, math=True, yio=1, pf=2048),
    "full, prefetch all B": dict(meta=True, math=True, yio=1, pf=1 << 20),
    "full, y tma/ptr, prefetch 768": dict(meta=True, math=True, yio=4, pf=768),
    "full, 8 warps": dict(meta=True, math=True, yio=1, warps=8),
    "full, 3 stages": dict(meta=True, math=True, yio=1, stages=3),
    "full, 6 stages": dict(meta=True, math=True, yio=1, stages=6),
    "full, meta early": dict(meta=2, math=True, yio=1),
    "full, meta early, rank late": dict(meta=3, math=True, yio=1),
    "full, meta early, rank late, y ptr": dict(meta=3, math=True, yio=2),
    "full, meta early, rank late, y tma/ptr": dict(meta=3, math=True, yio=4),
}


def ladder_fn(p: "bk.Proj", segs, meta: int, math: bool, yio: int, stages: int = 4, warps: int = 4, pf: int = 0):
    """_ladder_kernel for a one-slice projection (o, down), the shipped launcher's tiles and splits."""
    S, n, R, K = p.A.shape
    assert n == 1
    OUT = p.offs[-1]
    T = p.x.shape[0]
    block_n, splits = 256, 1  # the shipped launcher's tiles: whole slices in 256-column steps
    cols = triton.cdiv(OUT, block_n) * block_n
    out = torch.empty(T * splits, device=p.A.device, dtype=torch.float32)
    descs = (_desc(p.y, [1, block_n]), _desc(p.x, [1, 256]), _desc(p.A.view(S * R, K), [R, 256]),
             _desc(p.B.view(S * OUT, R), [block_n, R]))
    return lambda: _ladder_kernel[(T, 1, splits)](*descs, p.y, p.B, out, segs.starts, segs.lens, segs.slots, p.ranks,
                                                  K, OUT, R, R, cols, BLOCK_R=R, BLOCK_K=256, BLOCK_N=block_n,
                                                  STAGES=stages, META=int(meta), MATH=math, YIO=int(yio), PF=pf,
                                                  num_warps=warps)


@triton.jit
def _floor_flat_kernel(out_ptr, a_desc, b_desc, a_tiles, b_tiles, BOX: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    acc = tl.zeros((BOX, 256), dtype=tl.float32)
    for j in tl.range(pid, a_tiles + b_tiles, P, num_stages=STAGES):
        in_a = j < a_tiles
        acc += a_desc.load([tl.where(in_a, j, a_tiles) * BOX, 0]).to(tl.float32)
        acc += b_desc.load([tl.where(in_a, b_tiles, j - a_tiles) * BOX, 0]).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def _desc(t: torch.Tensor, box: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor.from_tensor(t, box)


def one_loop(y, x, A, B, segs, ranks, offs, scalings=None, stages=None, cols_per_prog=None):
    """lora_apply's fused TMA program as one loop (see the module docstring); the launcher's tiles."""
    T, K = x.shape
    S, n, R, _ = A.shape
    OUT = y.shape[1]
    d_bk, d_bn, d_st, d_w = TMA_TILES
    widest = max(b - a for a, b in zip(offs, offs[1:]))
    block_k = min(d_bk, max(16, triton.next_power_of_2(K)))
    block_n = block_n_for(offs, min(d_bn, max(16, triton.next_power_of_2(widest))))
    if cols_per_prog is None:  # round 7's column splits (the pointer body's rule); one step a program on CPU
        cols_per_prog = (_auto_cols_per_prog(segs.num_segs * n, widest, block_n, y.device)
                         if y.device.type == "cuda" else block_n)
    tok = segs.token_index if segs.token_index is not None else segs.starts
    grid = (segs.num_segs, n, triton.cdiv(widest, cols_per_prog))
    _one_loop_kernel[grid](
        _desc(y, [1, block_n]), _desc(x, [1, block_k]), _desc(A.view(S * n * R, K), [R, block_k]),
        _desc(B.view(S * OUT, R), [block_n, R]),
        scalings if scalings is not None else ranks, tok, segs.starts, segs.lens, segs.slots, ranks,
        T, K, OUT, R, n * R, offs[1] if n > 1 else OUT, offs[2] if n > 2 else OUT, cols_per_prog, S * n * R, S * OUT,
        BLOCK_R=R, BLOCK_K=block_k, BLOCK_N=block_n, STAGES=stages or d_st,
        GATHER=segs.token_index is not None, HAS_SCALE=scalings is not None, num_warps=d_w,
    )
    return y


def floor_grid_fn(p: "bk.Proj", T: int, stages: int):
    """The fused kernel's grid and TMA loads over tokens' slots 0..T-1, a sum only."""
    S, n, R, K = p.A.shape
    OUT = p.offs[-1]
    widest = max(b - a for a, b in zip(p.offs, p.offs[1:]))
    sms = torch.cuda.get_device_properties(p.A.device).multi_processor_count if p.A.device.type == "cuda" else 4
    n_steps = triton.cdiv(widest, 256)
    splits = 1 if K >= 2 * widest else max(1, min(n_steps, triton.cdiv(2 * sms, T * n)))
    block_n = 128 if K >= 2 * widest else 256
    cols = triton.cdiv(widest, block_n * splits) * block_n
    out = torch.empty(T * n * splits, device=p.A.device, dtype=torch.float32)
    a_d, b_d = _desc(p.A.view(S * n * R, K), [R, 256]), _desc(p.B.view(S * OUT, R), [block_n, R])
    grid = (T, n, splits)
    return lambda: _floor_grid_kernel[grid](out, a_d, b_d, K, OUT, n * R, R, cols, BLOCK_R=R, BLOCK_K=256,
                                            BLOCK_N=block_n, STAGES=stages, num_warps=4)


def floor_flat_fn(p: "bk.Proj", D: int, stages: int, waves: int = 4, box: int = 16):
    """D slots' A and B bytes as [rows, 256] tiles of `box` rows, streamed by waves x SMs programs."""
    a = p.A[:D].reshape(-1, 256)
    b = p.B[:D].reshape(-1, 256)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.device.type == "cuda" else 2
    out = torch.empty(waves * sms, device=a.device, dtype=torch.float32)
    a_d, b_d = _desc(a, [box, 256]), _desc(b, [box, 256])
    return lambda: _floor_flat_kernel[(waves * sms,)](out, a_d, b_d, a.shape[0] // box, b.shape[0] // box,
                                                      BOX=box, STAGES=stages, num_warps=4)


def check(smoke: bool) -> None:
    """one loop against the shipped TMA body: bits, mixed ranks, rank padding poisoned, scalings."""
    if smoke:
        bk.SLOTS = 8
    K, slices = (256, [256, 64, 64]) if smoke else bk.LLAMA_8B["qkv"]
    T = 8 if smoke else 64
    p = bk.Proj(K, slices, T)
    p.ranks[::3] = 8
    p.A[::3, :, 8:] = 1000.0
    p.B[::3, :, 8:] = float("nan")
    p.ranks[1] = 0
    scal = torch.rand(bk.SLOTS, device=p.A.device, dtype=torch.float32) + 0.5
    segs = bk.make_segments("triton", [1] * T, [i % bk.SLOTS for i in range(T)])
    want = p.y.clone()
    lora_apply(want, p.x, p.A, p.B, segs, p.ranks, p.offs, scal, fused=True, tma=True)
    for cols in (None, 64 if smoke else 1024):
        got = p.y.clone()
        one_loop(got, p.x, p.A, p.B, segs, p.ranks, p.offs, scal, cols_per_prog=cols)
        print(f"check one loop (cols_per_prog {cols}): bits equal to the TMA body: {torch.equal(got, want)}; "
              f"max abs diff {(got.float() - want.float()).abs().max().item():.3g}", flush=True)
    # the ladder's full bodies (one slice, no scalings) against the shipped TMA body: the same sums
    p = bk.Proj(256 if smoke else 4096, [256 if smoke else 4096], T)
    p.ranks[1] = 0
    segs = bk.make_segments("triton", [1] * T, [i % bk.SLOTS for i in range(T)])
    want = p.y.clone()
    lora_apply(want, p.x, p.A, p.B, segs, p.ranks, p.offs, fused=True, tma=True)
    for tag, kw in LADDER.items():
        if kw["meta"] and kw["math"] and kw["yio"] in (1, 2, 4) and not kw.get("pf"):  # (no inline asm here)
            p.y.zero_()
            ladder_fn(p, segs, **kw)()
            print(f"check ladder {tag}: bits equal to the TMA body: {torch.equal(p.y, want)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x256")
    ap.add_argument("--proj", default="o,qkv,gate_up,down")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--b2b", type=int, default=1)
    ap.add_argument("--stages", default="4", help="the one-loop variant's (empty: none)")
    ap.add_argument("--only", default="", help="a regex: time only the variants whose names it matches")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    check(args.smoke)
    if args.smoke:
        return
    bw = bk.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {bw / 1e9:.0f} GB/s", flush=True)
    stages = [int(s) for s in args.stages.split(",") if s]
    names, rows = [], []
    for shape in args.shapes.split(","):
        T, D = (int(v) for v in shape.split("x"))
        for proj in args.proj.split(","):
            K, slices = bk.LLAMA_8B[proj]
            p = bk.Proj(K, slices, T)
            segs = [bk.make_segments("triton", *it) for it in bk.layouts(T, D, T)]
            nbytes = D * (p.n * bk.RANK * K + p.offs[-1] * bk.RANK) * 2
            reps = max(1, -(-args.b2b // len(segs)))
            rd = torch.empty(nbytes // 2, device=p.A.device, dtype=torch.bfloat16)
            src = torch.empty(nbytes // 4, device=p.A.device, dtype=torch.bfloat16)
            dst = torch.empty_like(src)
            var = {"fused": lambda: [lora_apply(p.y, p.x, p.A, p.B, sg, p.ranks, p.offs) for sg in segs * reps]}
            for tag, kw in (("fused 8 warps", dict(num_warps=8)), ("fused 1 split", dict(cols_per_prog=1 << 16))):
                var[tag] = (lambda kw=kw: [lora_apply(p.y, p.x, p.A, p.B, sg, p.ranks, p.offs, fused=True, **kw)
                                           for sg in segs * reps])
            for st in stages:
                var[f"one loop st{st}"] = (lambda st=st: [one_loop(p.y, p.x, p.A, p.B, sg, p.ranks, p.offs, stages=st)
                                                          for sg in segs * reps])
            if D == T:
                for st in stages:
                    f = floor_grid_fn(p, T, st)
                    var[f"floor grid st{st}"] = lambda f=f: [f() for _ in range(len(segs) * reps)]
            if p.n == 1 and D == T:
                for tag, kw in LADDER.items():
                    f = ladder_fn(p, segs[0], **kw)
                    var[f"ladder {tag}"] = lambda f=f: [f() for _ in range(len(segs) * reps)]
            for waves, st in ((2, 4), (4, 4), (4, 6)):
                f = floor_flat_fn(p, D, st, waves)
                var[f"floor flat w{waves} st{st}"] = lambda f=f: [f() for _ in range(len(segs) * reps)]
            var["torch sum"] = lambda: [rd.sum(dtype=torch.float32) for _ in range(len(segs) * reps)]
            var["torch copy"] = lambda: [dst.copy_(src) for _ in range(len(segs) * reps)]
            if args.only:
                var = {v: f for v, f in var.items() if re.search(args.only, v)}
            names += [v for v in var if v not in names]
            ts = [t / (len(segs) * reps) for t in bk.interleaved_times(list(var.values()), reps=args.reps)]
            cells = {v: f"{t * 1e6:.1f} ({100 * nbytes / t / bw:.0f} %)" for v, t in zip(var, ts)}
            rows.append((f"| {proj} | {T} | {D} | {nbytes / 1e6:.1f} | ", cells))
            print(rows[-1][0] + " | ".join(f"{v} {c}" for v, c in cells.items()), flush=True)
            p = rd = src = dst = None
    print(f"\nµs (% of copy bandwidth for the adapter bytes), {args.b2b} back to back, interleaved medians "
          "(- : not run for that projection):\n")
    print("| proj | T | D | MB | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for head, cells in rows:
        print(head + " | ".join(cells.get(v, "-") for v in names) + " |")


if __name__ == "__main__":
    main()
