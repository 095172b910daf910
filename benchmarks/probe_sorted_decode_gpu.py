"""The decode CUDA graphs' slot-sorted LoRA kernels, one at a time, against their launch choices.

At batch 256 on 32 adapters (Llama-3.1-8B shape) the engine's decode step spends ~2.1-2.4 ms on LoRA
(docs/benchmarks.md, round 9-10), where its adapter bytes take ~0.6 ms at copy bandwidth. This probe
times the three kernels those steps run per projection on the layout the graphs build
(kernels/segments.sorted_segments_device: rows sorted by slot, chunks of lora.max_chunk_size rows):
lora_shrink (K-split planes, as LoRALinear._base_and_shrink), lora_expand (qkv, o, down) and
silu_mul_lora (gate_up, the expand inside the activation; silu_mul alone beside it), each with the
launcher's choice and tile overrides. Interleaved CUDA graphs with the L2 scrubbed before each timed
replay (bench_kernels_gpu.interleaved_times); GB/s over the bytes each must move (A or B of the
step's adapters, x / y / h rows).

    python3 benchmarks/probe_sorted_decode_gpu.py [--batch 256,128] [--adapters 32] [--proj qkv,o,gate_up,down]
        [--ops shrink,expand,silu] [--reps 11] [--only REGEX] [--layout sorted|rows]

--layout rows: one segment per row instead (the graphs' layout below 4 rows a slot; its expand and
silu_mul_lora take their one-token bodies).

--smoke runs every variant once on CPU under TRITON_INTERPRET=1 (tiny shapes), no timing.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_kernels_gpu import DEV, LLAMA_8B, copy_bandwidth, interleaved_times, offsets  # noqa: E402
from kernels.lora_expand import lora_expand  # noqa: E402
from kernels.lora_shrink import lora_shrink  # noqa: E402
from kernels.segments import LoRASegments, sorted_segments_device  # noqa: E402
from kernels.silu_mul import silu_mul  # noqa: E402
from kernels.silu_mul_lora import silu_mul_lora  # noqa: E402

RANK = 16
CHUNK = 16  # lora.max_chunk_size

# name -> launcher overrides; "" = the launcher's own choice (what the engine runs)
SHRINK = {"shrink": {}, "shrink sk6": {"split_k": 6}, "shrink sk2": {"split_k": 2}, "shrink sk4": {"split_k": 4},
          "shrink sk8": {"split_k": 8}, "shrink sk12": {"split_k": 12}, "shrink sk14": {"split_k": 14},
          "shrink sk16": {"split_k": 16},
          "shrink bk64": {"block_k": 64}, "shrink bk256": {"block_k": 256}, "shrink w8": {"num_warps": 8},
          "shrink st2": {"num_stages": 2}, "shrink st4": {"num_stages": 4}}
EXPAND = {"expand": {}, "expand loop": {"unroll": 0}, "expand h1": {"h_split": 1}, "expand h6": {"h_split": 6},
          "expand h14": {"h_split": 14}, "expand h16": {"h_split": 16}, "expand bn64": {"block_n": 64},
          "expand bn256": {"block_n": 256},
          "expand cpp256": {"cols_per_prog": 256}, "expand cpp512": {"cols_per_prog": 512},
          "expand cpp1024": {"cols_per_prog": 1024}, "expand bn256 cpp1024": {"block_n": 256, "cols_per_prog": 1024},
          "expand w8": {"num_warps": 8}, "expand st2": {"num_stages": 2}, "expand st4": {"num_stages": 4}}
SILU = {"silu": {}, "silu loop": {"unroll": 0}, "silu h1": {"h_split": 1}, "silu h16": {"h_split": 16},
        "silu bn128 loop": {"block_n": 128, "unroll": 0}, "silu bn32": {"block_n": 32}, "silu bn128": {"block_n": 128},
        "silu bn256": {"block_n": 256}, "silu cpp1024": {"cols_per_prog": 1024},
        "silu cpp2048": {"cols_per_prog": 2048}, "silu bn128 cpp2048": {"block_n": 128, "cols_per_prog": 2048},
        "silu st2": {"num_stages": 2}, "silu st4": {"num_stages": 4}, "silu w8": {"num_warps": 8}}


def setup(b: int, adapters: int, K: int, slices: list[int], layout: str) -> dict:
    """One projection's slot buffers (`adapters` slots, rank 16) and the decode graphs' layout of b rows,
    row i on slot i % adapters (the engine bench's assignment): "sorted" (slot-sorted chunks) or "rows"
    (one segment per row, what the graphs take below SORTED_MIN_ROWS_PER_SLOT rows a slot)."""
    n, offs = len(slices), offsets(slices)
    g = torch.Generator(device=DEV).manual_seed(0)
    A = (torch.randn(adapters, n, RANK, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    B = (torch.randn(adapters, offs[-1], RANK, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(b, K, device=DEV, generator=g).to(torch.bfloat16)
    y = torch.randn(b, offs[-1], device=DEV, generator=g).to(torch.bfloat16)
    ranks = torch.full((adapters,), RANK, dtype=torch.int32, device=DEV)
    row_slots = (torch.arange(b, device=DEV) % adapters).to(torch.int32)
    if layout == "sorted":
        segs = sorted_segments_device(row_slots, adapters, CHUNK)
    else:  # engine/cuda_graph.py's per-row layout
        starts = torch.arange(b, device=DEV, dtype=torch.int32)
        segs = LoRASegments(starts, torch.ones_like(starts), row_slots, None, 1)
    return {"A": A, "B": B, "x": x, "y": y, "ranks": ranks, "segs": segs, "offs": offs}


def planes(kw: dict, h0: torch.Tensor, x: torch.Tensor, A: torch.Tensor, segs, ranks) -> tuple[dict, torch.Tensor]:
    """A variant's kernel keywords and its h: h0 (the launcher's K split), or with "h_split" the planes
    of a shrink split that many ways (what the expand's plane loads cost)."""
    kw = dict(kw)
    split = kw.pop("h_split", None)
    if split is None:
        return kw, h0
    return kw, lora_shrink(x, A, segs, ranks, partials=True, split_k=split)


def variants(args: argparse.Namespace, table: dict) -> dict:
    if args.only:
        return {k: v for k, v in table.items() if re.search(args.only, k)}
    return table


def run(args: argparse.Namespace) -> list[str]:
    bw = copy_bandwidth() if DEV.type == "cuda" else 1.0
    lines = [f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); layout {args.layout}, {args.adapters} adapters", "",
             "| batch | proj | variant | µs | GB/s | % copy | max abs diff vs the launcher's choice |",
             "|---|---|---|---|---|---|---|"]
    for b in args.batch:
        for proj in args.proj:
            K, slices = LLAMA_8B[proj]
            if args.smoke:
                K, slices = 64, [s // 64 for s in slices]
            s = setup(b, args.adapters, K, slices, args.layout)
            A, B, x, y, ranks, segs, offs = s["A"], s["B"], s["x"], s["y"], s["ranks"], s["segs"], s["offs"]
            OUT = offs[-1]
            elt = 2
            h0 = lora_shrink(x, A, segs, ranks, partials=True)
            fns: dict[str, Callable[[], None]] = {}
            nbytes: dict[str, float] = {}
            check: dict[str, Callable[[], torch.Tensor]] = {}
            if "shrink" in args.ops:
                ref = h0.sum(0)
                for name, kw in variants(args, SHRINK).items():
                    fns[name] = (lambda kw=kw: lora_shrink(x, A, segs, ranks, partials=True, **kw))
                    nbytes[name] = (A.numel() + x.numel()) * elt
                    check[name] = (lambda kw=kw, ref=ref: (lora_shrink(x, A, segs, ranks, partials=True, **kw).sum(0)
                                                           - ref).abs().max())
            if "expand" in args.ops and proj != "gate_up":
                ref = lora_expand(y.clone(), h0, B, segs, ranks, offs)
                for name, kw in variants(args, EXPAND).items():
                    yy = y.clone()
                    kw, hh = planes(kw, h0, x, A, segs, ranks)
                    fns[name] = (lambda kw=kw, yy=yy, hh=hh: lora_expand(yy, hh, B, segs, ranks, offs, **kw))
                    nbytes[name] = (B.numel() + 2 * y.numel()) * elt + h0.numel() * 4
                    check[name] = (lambda kw=kw, ref=ref, hh=hh: (
                        lora_expand(y.clone(), hh, B, segs, ranks, offs, **kw).float() - ref.float()).abs().max())
            if "silu" in args.ops and proj == "gate_up":
                ref = silu_mul_lora(y, h0, B, segs, ranks)
                out = torch.empty(b, OUT // 2, device=DEV, dtype=torch.bfloat16)
                fns["silu_mul alone"] = lambda: silu_mul(y, out=out)
                nbytes["silu_mul alone"] = (y.numel() + out.numel()) * elt
                for name, kw in variants(args, SILU).items():
                    oo = torch.empty_like(out)
                    kw, hh = planes(kw, h0, x, A, segs, ranks)
                    fns[name] = (lambda kw=kw, oo=oo, hh=hh: silu_mul_lora(y, hh, B, segs, ranks, out=oo, **kw))
                    nbytes[name] = (B.numel() + y.numel() + out.numel()) * elt + h0.numel() * 4
                    check[name] = (lambda kw=kw, ref=ref, hh=hh: (silu_mul_lora(y, hh, B, segs, ranks, **kw).float()
                                                           - ref.float()).abs().max())
            if not fns:
                continue
            names = list(fns)
            diffs = {n: float(check[n]()) for n in names if n in check}
            times = interleaved_times([fns[n] for n in names], reps=args.reps) if not args.smoke else [1.0] * len(names)
            for n, t in zip(names, times):
                gbs = nbytes[n] / t / 1e9
                d = diffs.get(n)
                timing = "- | - | -" if args.smoke else f"{t * 1e6:.1f} | {gbs:.0f} | {100 * nbytes[n] / t / bw:.0f} %"
                lines.append(f"| {b} | {proj} | {n} | {timing} | {'' if d is None else f'{d:.2e}'} |")
            print("\n".join(lines[-len(names):]), flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="256,128")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--proj", default="qkv,o,gate_up,down")
    p.add_argument("--ops", default="shrink,expand,silu")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--only", default="", help="regex over variant names")
    p.add_argument("--layout", default="sorted", choices=["sorted", "rows"])
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    args.batch = [int(v) for v in args.batch.split(",")]
    args.proj = args.proj.split(",")
    args.ops = args.ops.split(",")
    if args.smoke:
        args.batch = [8]
        args.adapters = 2
    lines = run(args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
