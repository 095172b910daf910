"""Probe: the prefill LoRA delta in the epilogue of a Triton base GEMM (kernels/lora_gemm.py), on a GPU.

lora_linear's cuBLAS path writes the delta into y, then cuBLAS accumulates x @ Wᵀ into it: the LoRA
cost is the shrink's read of x plus one write of y. Its Triton path (gemm="triton") computes x @ Wᵀ in
lora_gemm and adds the delta in the epilogue: the LoRA cost is the shrink plus what the Triton GEMM
loses against cuBLAS. Per Llama-3.1-8B projection and T in (4096, 16384), one adapter over segments
of 4096 tokens, this times:
1. lora_gemm with no adapter row (the GEMM alone) per tile config against cuBLAS (one graph each);
2. then interleaved (one graph each, round robin, medians): cuBLAS twice (the noise), lora_linear on
   each path (the Triton one with step 1's best config), and the shrink alone. "LoRA % of base" =
   (lora_linear - cuBLAS) / cuBLAS: issue 6's figure (target <= 10 %).
First a correctness check (bf16, qkv shape, 3 adapters + base rows, both paths against fp32 torch).

    python3 benchmarks/probe_lora_gemm_gpu.py [--smoke] [--t 4096,16384] [--configs all|default]
    python3 benchmarks/probe_lora_gemm_gpu.py --table --t 1024,2048,4096,8192,16384   (no sweep: default tiles)
    python3 benchmarks/probe_lora_gemm_gpu.py --check-small    (SmolLM2 shapes, engine-like batch, fp16/bf16)
    python3 benchmarks/probe_lora_gemm_gpu.py --variants --t 4096,8192 [--proj qkv,o]
        (lora_gemm's tile order options, interleaved against cuBLAS: the ticket or the block index,
        GROUP_M, main-loop depth)
    python3 benchmarks/probe_lora_gemm_gpu.py --decompose --t 4096,8192 [--proj qkv,o]
        (lora_gemm's LoRA time split: the GEMM alone, + the epilogue's delta with h given, + the shrink)
    python3 benchmarks/probe_lora_gemm_gpu.py --chunks --t 16384 --proj qkv,gate_up [--chunk-rows 8192]
        (lora_gemm in one launch and in launches of --chunk-rows rows, against cuBLAS and the cuBLAS order)
    python3 benchmarks/probe_lora_gemm_gpu.py --activation --t 512,4096,8192
        (gate_up_proj as the engine's MLP runs it: its delta inside the activation, kernels/silu_mul_lora.py,
        against lora_linear's two orders followed by silu_mul; LoRA % of cuBLAS's GEMM)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

from bench_kernels_gpu import DEV, LLAMA_8B, copy_bandwidth, graph_time, interleaved_times  # noqa: E402
from kernels import reference as ref  # noqa: E402
import kernels.lora_gemm as lg  # noqa: E402
from kernels.lora_gemm import DEFAULT_TILES, lora_gemm  # noqa: E402
from kernels.lora_expand import lora_expand  # noqa: E402
from kernels.lora_linear import lora_linear  # noqa: E402
from kernels.lora_shrink import lora_shrink  # noqa: E402
from kernels.segments import sgmv_segments  # noqa: E402
from kernels.silu_mul import silu_mul  # noqa: E402
import kernels.silu_mul_lora as sml  # noqa: E402
from kernels.silu_mul_lora import silu_mul_lora  # noqa: E402

R, SLOTS = 16, 4
# (block_m, block_n, block_k, warps, stages, group_m, persistent)
CONFIGS = [(128, 256, 64, 8, 3, g, p) for g in (4, 8, 16) for p in (False, True)]
CONFIGS += [(256, 128, 64, 8, 3, 8, False)]
# the fused shrink's K step and depth on top of the main loop's tiles
FUSED_CONFIGS = [(128, 256, 64, 8, 3, g, p, ks, st) for g in (8, 16) for p in (False, True)
                 for ks, st in ((64, 3), (128, 3), (128, 4), (256, 2))]


def print_device() -> None:
    bw = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {bw:.0f} GB/s")


def offsets(slices):
    o = [0]
    for s in slices:
        o.append(o[-1] + s)
    return o


def projection(K: int, slices: list[int], slots: int):
    """One Llama-3.1-8B projection's bf16 operands at rank R: (N, offsets, W [N, K], A [slots, n, R, K],
    B [slots, N, R], slot ranks)."""
    N, n = sum(slices), len(slices)
    w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.02
    A = torch.randn(slots, n, R, K, device=DEV, dtype=torch.bfloat16) * 0.02
    B = torch.randn(slots, N, R, device=DEV, dtype=torch.bfloat16) * 0.02
    return N, offsets(slices), w, A, B, torch.full((slots,), R, dtype=torch.int32, device=DEV)


def one_adapter(T: int):
    """T tokens of slot 0 in segments of up to 4096 (one prefill sequence each)."""
    seq = min(T, 4096)
    return sgmv_segments([seq] * (T // seq), [0] * (T // seq), DEV)


def check(smoke: bool) -> None:
    K, slices = (4096, [4096, 1024, 1024]) if not smoke else (64, [64, 32, 32])
    lens = [1000, 500, 1300, 1296] if not smoke else [40, 9, 30, 17]
    slots = [0, -1, 2, 1]
    T, N = sum(lens), sum(slices)
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, K, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device=DEV, generator=g) / K ** 0.5).to(torch.bfloat16)
    A = (torch.randn(SLOTS, 3, R, K, device=DEV, generator=g) / K ** 0.5).to(torch.bfloat16)
    B = (torch.randn(SLOTS, N, R, device=DEV, generator=g) / R ** 0.5).to(torch.bfloat16)
    ranks = torch.tensor([16, 8, 4, 16], dtype=torch.int32, device=DEV)
    offs = offsets(slices)
    segs = sgmv_segments(lens, slots, DEV)
    ts = torch.tensor([s for n_, s in zip(lens, slots) for _ in range(n_)], device=DEV)
    want = ref.lora_expand(x.float() @ w.float().T, ref.lora_shrink(x.float(), A.float(), ts, ranks), B.float(),
                           ts, offs, ranks)
    for path in ("cublas", "triton"):
        cfgs = [None] if path == "cublas" or smoke else [None, (128, 256, 64, 8, 3, 8, True)]
        for c in cfgs:
            y = lora_linear(x, w, A, B, segs, ranks, offs, gemm=path, gemm_tiles=c)
            err = ((y.float() - want).norm() / want.norm()).item()
            print(f"check lora_linear gemm={path} {c}: rel err {err:.2e} against fp32 torch, NaN "
                  f"{bool(y.isnan().any())}", flush=True)
    h = lora_shrink(x, A, segs, ranks, partials=True, split_k=4)
    y = lora_gemm(x, w, h, B, segs.row_slots, ranks, offs)
    err = ((y.float() - want).norm() / want.norm()).item()
    print(f"check shrink (4 planes) + lora_gemm: rel err {err:.2e}, NaN {bool(y.isnan().any())}", flush=True)


def check_small(dev_smoke: bool = False) -> None:
    """SmolLM2-135M's projections, rank 8, an engine-like prefill batch (12 sequences of 20-200 tokens,
    4 adapters on 8 of them: row tiles span several adapters and base rows), fp16 and bf16: each path
    against fp64 torch, and the Triton path against the cuBLAS one. (fp32 through lora_gemm gave NaN on
    the H200 with triton 3.6: refused on CUDA, see kernels/lora_gemm.unfit_reason.)"""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(20, 200, (12,), generator=g).tolist()
    slots = [-1 if i in (4, 8, 9, 10) else i % 4 for i in range(12)]
    ts = torch.tensor([s for n_, s in zip(lens, slots) for _ in range(n_)], device=DEV)
    segs = sgmv_segments(lens, slots, DEV)
    ranks = torch.tensor([8, 8, 8, 8], dtype=torch.int32, device=DEV)
    for name, (K, slices) in {"qkv": (576, [576, 192, 192]), "o": (576, [576]), "gate_up": (576, [1536, 1536]),
                              "down": (1536, [576])}.items():
        N, n = sum(slices), len(slices)
        offs = offsets(slices)
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(sum(lens), K, generator=g).to(DEV, dtype)
            w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, dtype)
            A = (torch.randn(4, n, 8, K, generator=g) * 0.05).to(DEV, dtype)
            B = (torch.randn(4, N, 8, generator=g) * 0.05).to(DEV, dtype)
            want = ref.lora_expand(x.double() @ w.double().T, ref.lora_shrink(x.double(), A.double(), ts, ranks),
                                   B.double(), ts, offs, ranks)
            yt = lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton")
            yc = lora_linear(x, w, A, B, segs, ranks, offs, gemm="cublas")
            et = ((yt.double() - want).norm() / want.norm()).item()
            ec = ((yc.double() - want).norm() / want.norm()).item()
            d = (yt.double() - yc.double()).abs()
            i = int(d.argmax())
            print(f"check small {name:8s} {str(dtype):15s}: triton {et:.2e}, cublas {ec:.2e} against fp64; "
                  f"max |triton - cublas| {d.max().item():.3e} at row {i // N} col {i % N} "
                  f"(slot {int(ts[i // N])})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--t", default="4096,16384")
    p.add_argument("--configs", default="all")
    p.add_argument("--out", default=None)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--check-small", action="store_true", help="only check_small (SmolLM2 shapes, fp16/bf16)")
    p.add_argument("--variants", action="store_true", help="no sweep: VARIANTS interleaved against cuBLAS, per T")
    p.add_argument("--proj", default="qkv,o,gate_up,down")
    p.add_argument("--only", default="", help="--variants: these VARIANTS (names, comma-separated) beside the default")
    p.add_argument("--activation", action="store_true",
                   help="no sweep: gate_up_proj with its delta inside the activation against lora_linear + silu_mul")
    p.add_argument("--decompose", action="store_true",
                   help="no sweep: lora_gemm without adapter rows, with h given, and whole, against cuBLAS")
    p.add_argument("--table", action="store_true",
                   help="no tile sweep: the default tiles (and persistent), interleaved against cuBLAS, per T")
    p.add_argument("--chunks", action="store_true",
                   help="no sweep: lora_gemm in one launch and in --chunk-rows launches against cuBLAS")
    p.add_argument("--chunk-rows", type=int, default=8192)
    args = p.parse_args()
    if args.check_small:
        return check_small()
    check(args.smoke)
    if args.smoke:
        return
    if args.table:
        return table(args)
    if args.variants:
        return variants(args)
    if args.decompose:
        return decompose(args)
    if args.chunks:
        return chunks(args)
    if args.activation:
        return activation(args)
    dev = DEV
    print_device()
    configs = CONFIGS if args.configs == "all" else [DEFAULT_TILES]
    rows = []
    for name, (K, slices) in LLAMA_8B.items():
        N, offs, w, A, B, ranks = projection(K, slices, SLOTS)
        n = len(slices)
        for T in [int(t) for t in args.t.split(",")]:
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
            segs = sgmv_segments([4096] * (T // 4096), [0] * (T // 4096), dev)
            base_rows = torch.full((T,), -1, dtype=torch.int32, device=dev)
            h = torch.zeros(T, n, R, device=dev)
            cub = graph_time([lambda: torch.mm(x, w.t(), out=y)] * 3)
            gemm, fused = {}, {}
            for c in configs:
                try:
                    gemm[c] = graph_time([lambda c=c: lora_gemm(x, w, h, B, base_rows, ranks, offs, tiles=c)] * 3)
                except triton.runtime.errors.OutOfResources as e:
                    print(f"  {c}: {str(e).splitlines()[0][:120]}")
            for c in (FUSED_CONFIGS if args.configs == "all" else [DEFAULT_TILES]):
                try:
                    fused[c] = graph_time([lambda c=c: lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton",
                                                                   gemm_tiles=c)] * 3)
                except triton.runtime.errors.OutOfResources as e:
                    print(f"  {c}: {str(e).splitlines()[0][:120]}")
            best = min(gemm, key=gemm.get)
            best_fused = min(fused, key=fused.get)
            order = sorted(gemm, key=gemm.get)
            print(f"{name:8s} {T:6d} cuBLAS {cub * 1e6:.1f} µs; GEMM alone x cuBLAS: "
                  + ", ".join(f"{'/'.join(str(v) for v in c)} {gemm[c] / cub:.3f}" for c in order), flush=True)
            print("    with LoRA, shrink fused, x cuBLAS: " + ", ".join(
                f"{'/'.join(str(v) for v in c)} {fused[c] / cub:.3f}" for c in sorted(fused, key=fused.get)),
                flush=True)
            fns = {"cuBLAS": lambda: torch.mm(x, w.t(), out=y),
                   "cuBLAS again": lambda: torch.mm(x, w.t(), out=y),
                   "lora_linear cublas": lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="cublas"),
                   "lora_linear triton": lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton",
                                                             gemm_tiles=best_fused),
                   "lora_linear triton default": lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton"),
                   "shrink": lambda: lora_shrink(x, A, segs, ranks, partials=N <= 8192),
                   "shrink + lora_gemm": lambda: lora_gemm(x, w, lora_shrink(x, A, segs, ranks, partials=N <= 8192), B,
                                                           segs.row_slots, ranks, offs, tiles=best),
                   "lora_gemm alone": lambda: lora_gemm(x, w, h, B, base_rows, ranks, offs, tiles=best)}
            t = dict(zip(fns, interleaved_times(list(fns.values()), reps=9)))
            c = t["cuBLAS"]
            row = {"proj": name, "T": T, "best_tiles": best_fused, **{k: v * 1e6 for k, v in t.items()}}
            rows.append(row)
            print(f"{name:8s} {T:6d} " + " | ".join(f"{k} {v * 1e6:.1f}" for k, v in t.items())
                  + f" || LoRA % of base: cublas path {100 * (t['lora_linear cublas'] - c) / c:.1f}, "
                  f"triton path {100 * (t['lora_linear triton'] - c) / c:.1f}", flush=True)
    print("\n| proj | T | cuBLAS µs (again) | lora_linear cuBLAS path µs (% of base) | Triton path µs (% of base) "
          "| shrink µs | shrink + lora_gemm µs (% of base) | lora_gemm alone x cuBLAS | tiles |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["cuBLAS"]
        print(f"| {r['proj']} | {r['T']} | {c:.1f} ({r['cuBLAS again']:.1f}) | {r['lora_linear cublas']:.1f} "
              f"({100 * (r['lora_linear cublas'] - c) / c:.1f} %) | {r['lora_linear triton']:.1f} "
              f"({100 * (r['lora_linear triton'] - c) / c:.1f} %) | {r['shrink']:.1f} | {r['shrink + lora_gemm']:.1f} "
              f"({100 * (r['shrink + lora_gemm'] - c) / c:.1f} %) | "
              f"{r['lora_gemm alone'] / c:.3f} | {'/'.join(str(int(v)) for v in r['best_tiles'])} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


# (block_m, block_n, block_k, warps, stages, group_m, persistent, block_ks, shrink stages, ticket)
VARIANTS = {
    "default": None,
    "ticket, G8 (round 5's default)": (128, 256, 64, 8, 3, 8, None, 128, None, True),
    "no ticket G8": (128, 256, 64, 8, 3, 8, None, 128, None, False),
    "no ticket G16": (128, 256, 64, 8, 3, 16, None, 128, None, False),
    # a persistent grid (round 13: a plain persistent Triton GEMM is 1.7 points nearer cuBLAS than
    # lora_gemm's one tile a program for o_proj at 4096 tokens)
    "persistent G8": (128, 256, 64, 8, 3, 8, True, 128, None, False),
    "persistent G16": (128, 256, 64, 8, 3, 16, True, 128, None, False),
}


def one_adapter_cases(args: argparse.Namespace):
    """(projection name, T, projection(...) of 16 slots, x [T, K], y [T, N], one adapter's segments) for
    every --proj and --t: the operands --variants and --decompose time."""
    for name in args.proj.split(","):
        K, slices = LLAMA_8B[name]
        operands = projection(K, slices, 16)
        for T in [int(t) for t in args.t.split(",")]:
            x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
            y = torch.empty(T, operands[0], device=DEV, dtype=torch.bfloat16)
            yield name, T, operands, x, y, one_adapter(T)


def variants(args: argparse.Namespace) -> None:
    """Per projection and T: cuBLAS, lora_linear's cuBLAS order, and lora_gemm under each of VARIANTS
    (the fused shrink, one adapter over 4096-token segments), interleaved; LoRA % of cuBLAS's GEMM."""
    print_device()
    rows = []
    for name, T, (N, offs, w, A, B, ranks), x, y, segs in one_adapter_cases(args):
        want = lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton")
        fns = {"cuBLAS": lambda: torch.mm(x, w.t(), out=y),
               "cublas path": lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="cublas")}
        # the no-ticket wait's way out (a tile computing its row tile's h itself), forced on every tile
        lg.SPIN_LIMIT, limit = 0, lg.SPIN_LIMIT
        got = lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton", gemm_tiles=VARIANTS["no ticket G8"])
        lg.SPIN_LIMIT = limit
        print(f"  {name} {T}: every tile's own h (SPIN_LIMIT 0): bits equal to the default's: "
              f"{torch.equal(got, want)}", flush=True)
        for v, tiles in VARIANTS.items():
            if args.only and v not in args.only.split(",") and v != "default":
                continue
            got = lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton", gemm_tiles=tiles)
            if not torch.equal(got, want):
                print(f"  {name} {T} {v}: bits differ from the default's (max |diff| "
                      f"{(got.float() - want.float()).abs().max().item():.3e})", flush=True)
            fns[v] = lambda tiles=tiles: lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton",
                                                     gemm_tiles=tiles)
        t = dict(zip(fns, interleaved_times(list(fns.values()), reps=args.reps)))
        c = t["cuBLAS"]
        rows.append((name, T, {k: v * 1e6 for k, v in t.items()}))
        print(f"{name:8s} {T:6d} " + " | ".join(
            f"{k} {v * 1e6:.1f}" + ("" if k == "cuBLAS" else f" ({100 * (v - c) / c:+.1f} %)")
            for k, v in t.items()), flush=True)
    keys = list(rows[0][2]) if rows else []
    print("\n| proj | T | cuBLAS µs | " + " | ".join(k for k in keys[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(keys) - 1))
    for name, T, t in rows:
        c = t["cuBLAS"]
        print(f"| {name} | {T} | {c:.1f} | " + " | ".join(f"{100 * (t[k] - c) / c:.1f} %" for k in keys[1:]) + " |")


def decompose(args: argparse.Namespace) -> None:
    """Where lora_gemm's LoRA time goes, per projection and T (one adapter over 4096-token segments),
    interleaved against cuBLAS: the Triton GEMM with no adapter row (its epilogue adds nothing; the
    shrink tiles find no adapter), with h given (lora_shrink's output, computed once outside the
    timing: the epilogue's delta without the shrink or the flags), and whole (the shrink inside)."""
    print_device()
    rows = []
    for name, T, (N, offs, w, A, B, ranks), x, y, segs in one_adapter_cases(args):
        base_rows = torch.full((T,), -1, dtype=torch.int32, device=DEV)
        h = lora_shrink(x, A, segs, ranks)
        fns = {"cuBLAS": lambda: torch.mm(x, w.t(), out=y),
               "GEMM, no adapter row": lambda: lora_gemm(x, w, None, B, base_rows, ranks, offs, A=A),
               "GEMM + delta, h given": lambda: lora_gemm(x, w, h, B, segs.row_slots, ranks, offs),
               "GEMM + delta + shrink": lambda: lora_gemm(x, w, None, B, segs.row_slots, ranks, offs, A=A),
               "cuBLAS again": lambda: torch.mm(x, w.t(), out=y)}
        time_row(name, T, fns, args.reps, rows)
    print_rows(rows)


def time_row(name: str, T: int, fns: dict, reps: int, rows: list) -> None:
    """fns (the first "cuBLAS") timed interleaved; their µs appended to rows as (name, T, {fn: µs})
    and printed with each one's % over the first."""
    t = dict(zip(fns, interleaved_times(list(fns.values()), reps=reps)))
    rows.append((name, T, {k: v * 1e6 for k, v in t.items()}))
    c = t["cuBLAS"]
    print(f"{name:8s} {T:6d} " + " | ".join(f"{k} {v * 1e6:.1f} ({100 * (v - c) / c:+.1f} %)"
                                           for k, v in t.items()), flush=True)


def print_rows(rows: list) -> None:
    """time_row's rows as a markdown table: µs (% over cuBLAS)."""
    keys = list(dict.fromkeys(k for _, _, t in rows for k in t))
    print("\n| proj | T | cuBLAS µs | " + " | ".join(keys[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(keys) - 1))
    for name, T, t in rows:
        c = t["cuBLAS"]
        print(f"| {name} | {T} | {c:.1f} | " + " | ".join(
            f"{t[k]:.1f} ({100 * (t[k] - c) / c:+.1f} %)" if k in t else "-" for k in keys[1:]) + " |")


def chunks(args: argparse.Namespace) -> None:
    """lora_gemm over T rows in one launch, or in launches of --chunk-rows rows each (views of x and the
    row slots, each writing its own rows), against cuBLAS's GEMM and the cuBLAS order, interleaved:
    whether the rows a launch sees, not the shape, cost qkv_proj its figure above 8192 tokens."""
    print_device()
    rows = []
    c = args.chunk_rows
    for name, T, (N, offs, w, A, B, ranks), x, y, segs in one_adapter_cases(args):
        whole = lora_gemm(x, w, None, B, segs.row_slots, ranks, offs, A=A)
        parts = [lora_gemm(x[r:r + c], w, None, B, segs.row_slots[r:r + c], ranks, offs, A=A) for r in range(0, T, c)]
        print(f"  {name} {T}: chunks of {c} rows bit-equal to one launch: {torch.equal(torch.cat(parts), whole)}",
              flush=True)
        fns = {"cuBLAS": lambda: torch.mm(x, w.t(), out=y),
               "cublas path": lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="cublas"),
               "lora_gemm, one launch": lambda: lora_gemm(x, w, None, B, segs.row_slots, ranks, offs, A=A),
               f"lora_gemm, {c}-row launches": lambda: [
                   lora_gemm(x[r:r + c], w, None, B, segs.row_slots[r:r + c], ranks, offs, A=A)
                   for r in range(0, T, c)],
               "cuBLAS again": lambda: torch.mm(x, w.t(), out=y)}
        time_row(name, T, fns, args.reps, rows)
    print_rows(rows)


# silu_mul_lora's tile body: name -> (launcher overrides, TILE_WAVES or None)
ACTIVATION_TILES = {
    "default": ({}, None),
    "16-row": ({"block_m": 16}, None),
    "64-col": ({"block_n": 64}, None),
    "256-col": ({"block_n": 256}, None),
    "1 stage": ({"num_stages": 1}, None),
    "3 stages": ({"num_stages": 3}, None),
    "4 waves": ({}, 4),
    "16 waves": ({}, 16),
    "8 warps": ({"num_warps": 8}, None),
    "16 x 64": ({"block_m": 16, "block_n": 64}, None),
    "16-row, 3 stages": ({"block_m": 16, "num_stages": 3}, None),
    "64-col, 3 stages": ({"block_n": 64, "num_stages": 3}, None),
    "16 x 64, 3 stages": ({"block_m": 16, "block_n": 64, "num_stages": 3}, None),
    "16-row, 8 warps": ({"block_m": 16, "num_warps": 8}, None),
}


def activation(args: argparse.Namespace) -> None:
    """gate_up_proj, per T and layout (one adapter over 4096-token segments; 16 adapters over 512-token
    sequences with every fourth sequence a base one): the engine's MLP runs the GEMM and then the
    activation, so its LoRA time is (GEMM + LoRA + activation) - (cuBLAS GEMM + silu_mul), as % of the
    cuBLAS GEMM. Interleaved: the base pair; lora_linear (cuBLAS order; lora_gemm where it applies)
    + silu_mul; cuBLAS GEMM + lora_shrink + silu_mul_lora (the delta inside the activation) per tile.
    First each path's output against fp32 torch, and silu_mul_lora against lora_expand + silu_mul."""
    dev = DEV
    print_device()
    K, slices = LLAMA_8B["gate_up"]
    N, offs, w, A, B, ranks = projection(K, slices, 16)
    I = N // 2
    rows = []
    for T in [int(t) for t in args.t.split(",")]:
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        gu = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
        out = torch.empty(T, I, device=dev, dtype=torch.bfloat16)
        layouts = {"1": one_adapter(T)}
        if T >= 2048:
            n_seq = T // 512
            layouts["16x512"] = sgmv_segments([512] * n_seq, [-1 if i % 4 == 3 else i % 16 for i in range(n_seq)],
                                              dev)
        for layout, segs in layouts.items():
            def deferred(kw, waves, segs=segs):
                torch.mm(x, w.t(), out=gu)
                h = lora_shrink(x, A, segs, ranks, partials=True)
                keep = sml.TILE_WAVES
                sml.TILE_WAVES = waves or keep  # read by the launcher as the graph is captured
                try:
                    return silu_mul_lora(gu, h, B, segs, ranks, out=out, **kw)
                finally:
                    sml.TILE_WAVES = keep

            ts = segs.row_slots.long()
            want = ref.silu_mul(ref.lora_expand(x.float() @ w.float().T, ref.lora_shrink(
                x.float(), A.float(), ts, ranks), B.float(), ts, offs, ranks))
            fns = {"cuBLAS": lambda: torch.mm(x, w.t(), out=gu),
                   "cuBLAS + silu_mul": lambda: silu_mul(torch.mm(x, w.t(), out=gu), out=out),
                   "cublas order + silu_mul": lambda segs=segs: silu_mul(
                       lora_linear(x, w, A, B, segs, ranks, offs, gemm="cublas"), out=out)}
            if lg.unfit_reason(x, w, offs) is None:
                fns["lora_gemm + silu_mul"] = lambda segs=segs: silu_mul(
                    lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton"), out=out)
            fns["shrink"] = lambda segs=segs: lora_shrink(x, A, segs, ranks, partials=True)
            for name, (kw, waves) in ACTIVATION_TILES.items():
                fns[f"in activation, {name}"] = lambda kw=kw, waves=waves: deferred(kw, waves)
            for k in [k for k in list(fns)[2:] if k != "shrink"]:
                got = fns[k]().float()
                print(f"  {T} {layout} {k}: rel err {((got - want).norm() / want.norm()).item():.2e} "
                      f"against fp32 torch, NaN {bool(got.isnan().any())}", flush=True)
            h = lora_shrink(x, A, segs, ranks, partials=True)
            torch.mm(x, w.t(), out=gu)
            two = silu_mul(lora_expand(gu.clone(), h, B, segs, ranks, offs))
            print(f"  {T} {layout}: silu_mul_lora bits equal to lora_expand + silu_mul: "
                  f"{torch.equal(silu_mul_lora(gu, h, B, segs, ranks), two)}", flush=True)
            t = dict(zip(fns, interleaved_times(list(fns.values()), reps=args.reps)))
            c, base = t["cuBLAS"], t["cuBLAS + silu_mul"]
            rows.append((T, layout, {k: v * 1e6 for k, v in t.items()}))
            print(f"gate_up {T:6d} {layout:7s} " + " | ".join(
                f"{k} {v * 1e6:.1f}" + ("" if k in ("cuBLAS", "cuBLAS + silu_mul", "shrink") else
                                        f" ({100 * (v - base) / c:+.1f} %)") for k, v in t.items()), flush=True)
    keys = list(rows[0][2]) if rows else []
    print("\n| T | adapters | cuBLAS µs | + silu_mul µs | " + " | ".join(keys[2:]) + " |")
    print("|---|---|---|---|" + "---|" * (len(keys) - 2))
    for T, layout, t in rows:
        c, base = t["cuBLAS"], t["cuBLAS + silu_mul"]
        print(f"| {T} | {layout} | {c:.1f} | {base:.1f} | " + " | ".join(
            (f"{t[k]:.1f} µs" if k == "shrink" else f"{100 * (t[k] - base) / c:.1f} %") if k in t else "-"
            for k in keys[2:]) + " |")


def table(args: argparse.Namespace) -> None:
    """Per projection and T: cuBLAS, lora_linear's two paths (Triton: default tiles, and the same tiles on a
    persistent grid), interleaved; one adapter over 4096-token segments (shorter T: one segment), and
    16 adapters over 512-token sequences."""
    dev = DEV
    print_device()
    rows = []
    persistent = DEFAULT_TILES[:6] + (True,) + DEFAULT_TILES[7:]
    for name, (K, slices) in LLAMA_8B.items():
        N, offs, w, A, B, ranks = projection(K, slices, 16)
        for T in [int(t) for t in args.t.split(",")]:
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
            for layout in ("1", "16x512"):
                if layout == "1":
                    segs = one_adapter(T)
                elif T >= 8192:
                    segs = sgmv_segments([512] * (T // 512), [i % 16 for i in range(T // 512)], dev)
                else:
                    continue
                fns = {"cuBLAS": lambda: torch.mm(x, w.t(), out=y),
                       "cublas path": lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="cublas"),
                       "triton path": lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton"),
                       "triton persistent": lambda: lora_linear(x, w, A, B, segs, ranks, offs, gemm="triton",
                                                                gemm_tiles=persistent)}
                t = dict(zip(fns, interleaved_times(list(fns.values()), reps=9)))
                c = t["cuBLAS"]
                row = {"proj": name, "T": T, "layout": layout, **{k: v * 1e6 for k, v in t.items()}}
                rows.append(row)
                print(f"{name:8s} {T:6d} {layout:7s} " + " | ".join(
                    f"{k} {v * 1e6:.1f}" + ("" if k == "cuBLAS" else f" ({100 * (v - c) / c:+.1f} %)")
                    for k, v in t.items()), flush=True)
    print("\n| proj | T | adapters | cuBLAS µs | cuBLAS path: LoRA % of base | Triton path "
          "| Triton, persistent grid |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["cuBLAS"]
        print(f"| {r['proj']} | {r['T']} | {r['layout']} | {c:.1f} | "
              + " | ".join(f"{100 * (r[k] - c) / c:.1f} %" for k in ("cublas path", "triton path", "triton persistent"))
              + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
