"""Multi-LoRA kernels on one CUDA GPU: a correctness check, then time / GB/s / TFLOP/s on Llama-3.1-8B shapes.

Not a test. Imports only torch, triton and the repo's `kernels` package (the GPU host has no hydra or
starlette). Run from the repo root:

    python3 benchmarks/bench_kernels_gpu.py [--budget-s 240] [--out FILE]

1. Correctness: both strategies against kernels/reference.py on the GPU (compiled, not interpreted):
   bf16/fp16/fp32, decode and prefill, mixed ranks with NaN in B's rank padding, base tokens.
2. Ceilings measured in the same run: device-to-device copy bandwidth (bytes read + written) and a
   bf16 matrix product.
3. Decode: T tokens (1..256), D distinct rank-16 adapters (1..256), token i on adapter i % D, for each
   projection of Llama-3.1-8B (qkv, o, gate_up, down). The time is shrink + expand (one LoRA
   application), from CUDA-graph replays, so Python launch overhead is out. The weights rotate over
   256 slots across the replayed iterations so they come from HBM, not from the 60 MB L2.
   "adapter GB/s" counts the A and B bytes of the D adapters, the bytes the op must read; "% copy" is
   that against the measured copy bandwidth (the target is >= 70 %).
4. Prefill: 4k and 16k tokens in sequences of 4k, 1 or 4 adapters: LoRA time against the base
   projection's (x @ Wᵀ, bf16, cuBLAS) time (the target is <= 10 %).
The torch reference is the engine's `torch` backend (gathered below 64 tokens, grouped above).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.lora_expand import lora_expand  # noqa: E402
from kernels.lora_shrink import lora_shrink  # noqa: E402
from kernels.segments import LoRASegments, csgmv_segments, sgmv_segments  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: --smoke under TRITON_INTERPRET=1
LLAMA_8B = {  # projection -> (in features, output slices)
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
RANK = 16
SLOTS = 256
GATHER_MAX_TOKENS = 64  # appliance/lora/batch.py: the torch backend's gathered path up to this many tokens
DECODE = [(256, 256), (64, 64), (1, 1), (256, 16), (16, 16), (256, 1), (64, 8), (256, 64), (16, 1), (64, 1)]
PREFILL = [(4096, 1), (16384, 1), (16384, 4)]
PREFILL_SEQ = 4096  # tokens per prefill sequence
TUNE = [("qkv", 256, 256, 1), ("gate_up", 256, 256, 1), ("qkv", 16384, 1, 4096), ("gate_up", 16384, 1, 4096)]
STRATEGIES = {"triton": None, "csgmv16": 16, "csgmv64": 64}


def offsets(slices: list[int]) -> list[int]:
    out = [0]
    for s in slices:
        out.append(out[-1] + s)
    return out


def make_segments(strategy: str, seg_lens: list[int], seg_slots: list[int]) -> LoRASegments:
    chunk = STRATEGIES[strategy]
    if chunk is None:
        return sgmv_segments(seg_lens, seg_slots, DEV)
    return csgmv_segments(seg_lens, seg_slots, chunk, DEV)


# ------------------------------------------------------------------ correctness
def check(strategy: str, dtype: torch.dtype, seg_lens: list[int], seg_slots: list[int], ranks: list[int],
          K: int, slices: list[int], R: int) -> tuple[bool, float]:
    g = torch.Generator(device=DEV).manual_seed(0)
    S, n, offs = len(ranks), len(slices), offsets(slices)
    T, OUT = sum(seg_lens), offs[-1]
    A = (torch.randn(S, n, R, K, device=DEV, generator=g) / math.sqrt(K)).to(dtype)
    B = (torch.randn(S, OUT, R, device=DEV, generator=g) / math.sqrt(R)).to(dtype)
    for s, r in enumerate(ranks):
        A[s, :, r:] = 1000.0
        B[s, :, r:] = float("nan")
    x = torch.randn(T, K, device=DEV, generator=g).to(dtype)
    y0 = torch.randn(T, OUT, device=DEV, generator=g).to(dtype)
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    token_slots = torch.tensor([s for m, s in zip(seg_lens, seg_slots) for _ in range(m)], device=DEV)
    want = ref.lora_expand(y0.clone(), ref.lora_shrink(x, A, token_slots, ranks_t), B, token_slots, offs, ranks_t)
    segs = make_segments(strategy, seg_lens, seg_slots)
    y = y0.clone()
    lora_expand(y, lora_shrink(x, A, segs, ranks_t), B, segs, ranks_t, offs)
    err = ((y.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}[dtype]
    base = token_slots < 0
    ok = err <= tol and torch.equal(y[base], y0[base])
    return ok, err


def run_checks(smoke: bool) -> bool:
    cases = []
    shapes = [(4096, [4096, 1024, 1024]), (14336, [4096]), (576, [576, 192, 192])] if not smoke else [(64, [64, 16, 16])]
    for strategy in STRATEGIES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32) if not smoke else (torch.bfloat16,):
            cases.append((strategy, dtype, [1] * 40, [(i * 7) % 9 - 1 for i in range(40)], "decode"))
            cases.append((strategy, dtype, [300, 1, 700, 45], [0, -1, 3, 0], "prefill"))
    all_ok, n_checked = True, 0
    for strategy, dtype, lens, slots, shape in cases:
        # bf16 (the serving dtype) on every shape; fp16 and fp32 on qkv (each shape compiles anew)
        for K, slices in (shapes if dtype == torch.bfloat16 else shapes[:1]):
            ok, err = check(strategy, dtype, lens, slots, [16, 8, 1, 16, 0, 5, 16, 12], K, slices, 16)
            n_checked += 1
            all_ok &= ok
            if not ok:
                print(f"FAIL {strategy} {dtype} {shape} K={K} {slices}: max rel err {err:.2e}")
    print(f"correctness: {n_checked} cases, {'all passed' if all_ok else 'FAILURES above'}", flush=True)
    return all_ok


# ------------------------------------------------------------------ timing
def graph_time(fns: list[Callable[[], None]], reps: int = 5) -> float:
    """Seconds per call of one fn, from CUDA-graph replays of all fns back to back."""
    if DEV.type == "cpu":  # --smoke: exercises the code paths only (no CUDA events either)
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) / len(fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:  # warm-up: compiles the kernels, allocates
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written; the faster of plain launches and a graph."""
    src = torch.randn((2**30 if DEV.type == "cuda" else 2**19), device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    if DEV.type == "cpu":
        return nbytes / graph_time([lambda: dst.copy_(src)])
    eager = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        eager.append(a.elapsed_time(b) / 1e3)
    t = min(sorted(eager[2:])[len(eager[2:]) // 2], graph_time([lambda: dst.copy_(src)] * 4, reps=5))
    return nbytes / t


def matmul_time(T: int, K: int, OUT: int) -> float:
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(OUT, K, device=DEV, dtype=torch.bfloat16)
    return graph_time([lambda: torch.mm(x, w.t())] * 3, reps=5)


class Proj:
    """One projection's slot buffers (SLOTS adapters at rank 16) and activations for T tokens."""

    def __init__(self, K: int, slices: list[int], T: int) -> None:
        self.K, self.offs, self.n = K, offsets(slices), len(slices)
        OUT = self.offs[-1]
        self.A = torch.randn(SLOTS, self.n, RANK, K, device=DEV, dtype=torch.bfloat16) * 0.02
        self.B = torch.randn(SLOTS, OUT, RANK, device=DEV, dtype=torch.bfloat16) * 0.02
        self.ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device=DEV)
        self.x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        self.y = torch.zeros(T, OUT, device=DEV, dtype=torch.bfloat16)

    def kernel_fn(self, segs: LoRASegments) -> Callable[[], None]:
        def fn() -> None:
            h = lora_shrink(self.x, self.A, segs, self.ranks)
            lora_expand(self.y, h, self.B, segs, self.ranks, self.offs)
        return fn

    def torch_fn(self, seg_lens: list[int], seg_slots: list[int]) -> Callable[[], None]:
        token_slots = torch.tensor([s for m, s in zip(seg_lens, seg_slots) for _ in range(m)], device=DEV)
        per_slot: dict[int, list[int]] = {}
        row = 0
        for m, s in zip(seg_lens, seg_slots):
            per_slot.setdefault(s, []).extend(range(row, row + m))
            row += m
        groups = [(s, torch.tensor(v, device=DEV)) for s, v in sorted(per_slot.items())]
        if len(groups) > 1 and len(token_slots) <= GATHER_MAX_TOKENS:
            return lambda: ref.lora_apply_gathered(self.y, self.x, self.A, self.B, token_slots, self.offs)
        return lambda: ref.lora_apply_grouped(self.y, self.x, self.A, self.B, groups, self.offs)


def layouts(T: int, D: int, num_seqs: int) -> list[tuple[list[int], list[int]]]:
    """Iterations whose adapters rotate over every slot, so repeated replays miss the L2."""
    per = T // num_seqs
    sets = max(1, SLOTS // D)
    return [([per] * num_seqs, [(k * D + i % D) % SLOTS for i in range(num_seqs)]) for k in range(sets)]


def bench(args: argparse.Namespace) -> list[str]:
    t_start = time.time()
    bw = copy_bandwidth()
    m = 8192 if DEV.type == "cuda" else 64
    mm = matmul_time(m, m, m)
    lines = [f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); bf16 {m}^3 matmul "
             f"{2 * m**3 / mm / 1e12:.0f} TFLOP/s", ""]
    head = ("| proj | T | D | base µs | " + " | ".join(f"{s} µs (% base)" for s in STRATEGIES)
            + " | torch µs (% base) | TFLOP/s (best) |")
    lines += ["Prefill (sequences of 4096 tokens, rank 16, bf16; base = x @ Wᵀ through cuBLAS):", "",
              head, "|" + "---|" * (head.count("|") - 1)]
    rows = [(name, K, slices, T, D) for name, (K, slices) in LLAMA_8B.items() for T, D in PREFILL]
    for name, K, slices, T, D in rows:
        if time.time() - t_start > 0.4 * args.budget_s:  # leave the rest of the budget to decode
            lines.append(f"(prefill's share of the budget spent: stopped before {name} T={T} D={D})")
            break
        if True:
            p = Proj(K, slices, T)
            its = layouts(T, D, T // PREFILL_SEQ)[:1]
            base = matmul_time(T, K, p.offs[-1])
            flops = 2 * T * RANK * (p.n * K + p.offs[-1])
            cells, best = [], math.inf
            for strategy in STRATEGIES:
                t = graph_time([p.kernel_fn(make_segments(strategy, *its[0]))])
                best = min(best, t)
                cells.append(f"{t * 1e6:.1f} ({100 * t / base:.1f} %)")
            tt = graph_time([p.torch_fn(*its[0])])
            row = (f"| {name} | {T} | {D} | {base * 1e6:.0f} | " + " | ".join(cells)
                   + f" | {tt * 1e6:.1f} ({100 * tt / base:.1f} %) | {flops / best / 1e12:.1f} |")
            lines.append(row)
            print(row, flush=True)
            del p
    head = ("| proj | T | D | " + " | ".join(f"{s} µs | {s} adapter GB/s (% copy)" for s in STRATEGIES)
            + " | torch µs | TFLOP/s (best) |")
    lines += ["", "Decode (shrink + expand, rank 16, bf16; CUDA-graph replay, weights rotated past the L2):", "",
              head, "|" + "---|" * (head.count("|") - 1)]
    print(lines[0], flush=True)
    for T, D in DECODE:  # most telling first, should the budget run out
        for name, (K, slices) in LLAMA_8B.items():
            if time.time() - t_start > args.budget_s:
                lines.append(f"(budget of {args.budget_s} s spent: stopped before {name} T={T} D={D})")
                return lines
            p = Proj(K, slices, T)
            its = layouts(T, D, T)
            n_bytes = D * (p.n * RANK * K + p.offs[-1] * RANK) * 2
            flops = 2 * T * RANK * (p.n * K + p.offs[-1])
            cells, best = [], math.inf
            for strategy in STRATEGIES:
                t = graph_time([p.kernel_fn(make_segments(strategy, *it)) for it in its])
                best = min(best, t)
                cells.append(f"{t * 1e6:.1f} | {n_bytes / t / 1e9:.0f} ({100 * n_bytes / t / bw:.0f} %)")
            tt = graph_time([p.torch_fn(*it) for it in its])
            row = f"| {name} | {T} | {D} | " + " | ".join(cells) + f" | {tt * 1e6:.1f} | {flops / best / 1e12:.2f} |"
            lines.append(row)
            print(row, flush=True)
            del p
    return lines


def tune(args: argparse.Namespace, bw: float) -> list[str]:
    """Shrink and expand timed apart under other tile choices than the launchers' (marked *)."""
    lines = ["", "Tile choices, shrink and expand timed apart (triton strategy; * = the launchers' default):", "",
             "| op | proj | T | D | block_m | block_n/k | warps | µs | GB/s moved |", "|---|---|---|---|---|---|---|---|---|"]
    for name, T, D, seq in TUNE:
        K, slices = LLAMA_8B[name]
        p = Proj(K, slices, T)
        its = layouts(T, D, T // seq)
        segs = [make_segments("triton", *it) for it in its]
        decode = seq == 1
        h = lora_shrink(p.x, p.A, segs[0], p.ranks)
        a_bytes = D * p.n * RANK * K * 2 + T * K * 2
        b_bytes = D * p.offs[-1] * RANK * 2 + 2 * T * p.offs[-1] * 2
        shrink_cfgs = [(None, None, None), (None, 256, 4), (None, 64, 4), (None, 128, 8)] if decode else \
            [(None, None, None), (128, 128, 4), (128, 64, 8), (64, 64, 4), (64, 128, 8)]
        expand_cfgs = [(None, None, None), (16, 128, 4), (16, 512, 4), (16, 256, 8)] if decode else \
            [(None, None, None), (64, 128, 4), (128, 128, 8), (64, 256, 8), (32, 128, 4)]
        for bm, bk, w in shrink_cfgs:
            t = graph_time([lambda sg=sg: lora_shrink(p.x, p.A, sg, p.ranks, block_m=bm, block_k=bk, num_warps=w)
                            for sg in segs])
            star = "*" if bm is None and bk is None else ""
            lines.append(f"| shrink{star} | {name} | {T} | {D} | {bm or '-'} | {bk or '-'} | {w or '-'} | "
                         f"{t * 1e6:.1f} | {a_bytes / t / 1e9:.0f} ({100 * a_bytes / t / bw:.0f} %) |")
        for bm, bn, w in expand_cfgs:
            t = graph_time([lambda sg=sg: lora_expand(p.y, h, p.B, sg, p.ranks, p.offs, block_m=bm, block_n=bn,
                                                      num_warps=w) for sg in segs])
            star = "*" if bm is None else ""
            lines.append(f"| expand{star} | {name} | {T} | {D} | {bm or '-'} | {bn or '-'} | {w or '-'} | "
                         f"{t * 1e6:.1f} | {b_bytes / t / 1e9:.0f} ({100 * b_bytes / t / bw:.0f} %) |")
        print("\n".join(lines[-len(shrink_cfgs) - len(expand_cfgs):]), flush=True)
        del p, h
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing new rows after this long")
    ap.add_argument("--out", help="also write the tables to this file")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-tune", action="store_true", help="no table of other tile choices")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: check the script itself (CPU + interpreter)")
    args = ap.parse_args()
    if args.smoke:
        global SLOTS, DECODE, PREFILL, PREFILL_SEQ, TUNE
        SLOTS, DECODE, PREFILL, PREFILL_SEQ = 8, [(1, 1), (4, 2), (8, 8)], [(64, 1), (128, 2)], 64
        TUNE = [("qkv", 8, 8, 1), ("gate_up", 128, 1, 64)]
        for name, (K, slices) in list(LLAMA_8B.items()):
            LLAMA_8B[name] = (K // 64, [s // 64 for s in slices])
    gpu = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter)"
    print(f"{gpu} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    ok = True if args.skip_check else run_checks(args.smoke)
    lines = bench(args)
    if not args.skip_tune:
        lines += tune(args, copy_bandwidth())
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
