"""Multi-LoRA kernels on one CUDA GPU: a correctness check, then time / GB/s / TFLOP/s on Llama-3.1-8B shapes.

Not a test. Imports only torch, triton and the repo's `kernels` package (the GPU host has no hydra or
starlette). Run from the repo root:

    python3 benchmarks/bench_kernels_gpu.py [--budget-s 240] [--out FILE] [--tune-first] [--skip-torch]
        [--before-pkg kernels_old[,kernels_mid]] [--prefill-t 4096,16384] [--decode-rows N]

1. Correctness: both strategies against kernels/reference.py on the GPU (compiled, not interpreted):
   bf16/fp16/fp32, decode (through lora_apply's fused kernel and through shrink + expand, the expand
   a programmatic dependent of the shrink or not, the former also replayed from a CUDA graph) and
   prefill (lora_apply; lora_linear with the shrink's K splits in planes or atomics, with and without
   PDL), mixed ranks with NaN in B's rank padding, base tokens.
2. Ceilings measured in the same run: device-to-device copy bandwidth (bytes read + written) and a
   bf16 matrix product.
3. Prefill: 64 to 16k tokens in sequences of up to 4k, 1 or 4 adapters: LoRA time against the base
   projection's (x @ Wᵀ, bf16, cuBLAS) time (the target is <= 10 %). The LoRA time is the whole
   wrapped projection's time minus the base GEMM's: kernels/lora_linear.py (delta written first, the
   GEMM accumulating into it: what the engine runs for prefill steps from 64 tokens) with the shrink's
   K splits atomic, in planes, or none, and the add-after order (GEMM, then lora_apply adding into y:
   the engine below 64 tokens).
4. Decode: T tokens (1..256), D distinct rank-16 adapters (1..256), token i on adapter i % D, for each
   projection of Llama-3.1-8B (qkv, o, gate_up, down). The time is one LoRA application
   (kernels/lora_apply.py: fused, or shrink + expand), from CUDA-graph replays, so Python launch
   overhead is out; "b2b" replays >= 8 applications back to back in one graph. The weights rotate over
   256 slots across the replayed iterations so they come from HBM, not from the 60 MB L2.
   "adapter GB/s" counts the A and B bytes of the D adapters, the bytes the op must read; "% copy" is
   that against the measured copy bandwidth (the target is >= 70 %). "same bytes read": one torch sum
   over a buffer of those bytes, timed the same way: what a plain read of that size reaches with its
   own launch, ramp and tail (context for the small applications, o_proj's 67 MB; not the target).
--before-pkg NAME[,NAME2]: earlier copies of the kernels/ package, importable as NAME (their own imports
rewritten to NAME), each timed in a "before" column in the same run: an A/B free of run-to-run drift.
The torch reference is the engine's `torch` backend (gathered below 64 tokens, grouped above).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.lora_apply import lora_apply  # noqa: E402
from kernels.lora_expand import lora_expand  # noqa: E402
from kernels.lora_linear import lora_linear  # noqa: E402
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
PREFILL = [(64, 1), (128, 1), (256, 1), (1024, 1), (4096, 1), (16384, 1), (16384, 4)]
PREFILL_SEQ = 4096  # tokens per prefill sequence
STRATEGIES = {"triton": None, "csgmv16": 16, "csgmv64": 64}
BEFORE: list = []  # --before-pkg: (name, lora_apply, lora_linear) of each earlier kernels package


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
# Relative error allowed against the fp32 twin, per dtype (the tests' tolerance table).
CHECK_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def check_case(g: torch.Generator, dtype: torch.dtype, seg_lens: list[int], seg_slots: list[int],
               ranks: list[int], K: int, slices: list[int], R: int):
    """One correctness case's inputs: A, B (rank padding poisoned: 1000 in A, NaN in B), x, the slot
    ranks, each token's slot and the output offsets."""
    S, n, offs = len(ranks), len(slices), offsets(slices)
    T, OUT = sum(seg_lens), offs[-1]
    A = (torch.randn(S, n, R, K, device=DEV, generator=g) / math.sqrt(K)).to(dtype)
    B = (torch.randn(S, OUT, R, device=DEV, generator=g) / math.sqrt(R)).to(dtype)
    for s, r in enumerate(ranks):
        A[s, :, r:] = 1000.0
        B[s, :, r:] = float("nan")
    x = torch.randn(T, K, device=DEV, generator=g).to(dtype)
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    token_slots = torch.tensor([s for m, s in zip(seg_lens, seg_slots) for _ in range(m)], device=DEV)
    return A, B, x, ranks_t, token_slots, offs


def check(strategy: str, dtype: torch.dtype, seg_lens: list[int], seg_slots: list[int], ranks: list[int],
          K: int, slices: list[int], R: int, apply_kw: dict) -> tuple[bool, float]:
    g = torch.Generator(device=DEV).manual_seed(0)
    A, B, x, ranks_t, token_slots, offs = check_case(g, dtype, seg_lens, seg_slots, ranks, K, slices, R)
    y0 = torch.randn(x.shape[0], offs[-1], device=DEV, generator=g).to(dtype)
    want = ref.lora_expand(y0.clone(), ref.lora_shrink(x, A, token_slots, ranks_t), B, token_slots, offs, ranks_t)
    segs = make_segments(strategy, seg_lens, seg_slots)
    y = y0.clone()
    lora_apply(y, x, A, B, segs, ranks_t, offs, **apply_kw)  # fused None: when every segment is one token
    if apply_kw.get("pdl") and DEV.type == "cuda":
        # the programmatic dependent launch captured in a CUDA graph (as the engine's decode graphs
        # run it): warm-up above, capture, then one replay on a fresh copy of y
        g_ = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_):
            lora_apply(y, x, A, B, segs, ranks_t, offs, **apply_kw)
        y.copy_(y0)
        g_.replay()
        torch.cuda.synchronize()
    err = ((y.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
    tol = CHECK_TOL[dtype]
    base = token_slots < 0
    ok = err <= tol and torch.equal(y[base], y0[base])
    return ok, err


def check_linear(strategy: str, dtype: torch.dtype, seg_lens: list[int], seg_slots: list[int], ranks: list[int],
                 K: int, slices: list[int], R: int, partials: bool, pdl=None) -> tuple[bool, float]:
    """kernels/lora_linear.py against its torch twin, NaN in B's rank padding, base tokens in between."""
    g = torch.Generator(device=DEV).manual_seed(1)
    A, B, x, ranks_t, token_slots, offs = check_case(g, dtype, seg_lens, seg_slots, ranks, K, slices, R)
    W = (torch.randn(offs[-1], K, device=DEV, generator=g) / math.sqrt(K)).to(dtype)
    want = ref.lora_linear(x, W, A, B, token_slots, offs, ranks_t)
    segs = make_segments(strategy, seg_lens, seg_slots)
    y = lora_linear(x, W, A, B, segs, ranks_t, offs, split_k=4, partials=partials, pdl=pdl)
    err = ((y.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
    tol = CHECK_TOL[dtype]
    return err <= tol, err


def run_checks(smoke: bool) -> bool:
    cases = []
    shapes = [(4096, [4096, 1024, 1024]), (14336, [4096]), (576, [576, 192, 192])] if not smoke else [(64, [64, 16, 16])]
    strategies = ["triton", "csgmv64"]  # csgmv16 differs from csgmv64 by its chunk size only
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if not smoke else (torch.bfloat16,)
    # decode: the fused kernel (the launcher's tiles, then 512-column steps), then lora_shrink + lora_expand
    # (the unfused path with and without the expand as a programmatic dependent of the shrink)
    decode_kws = [dict(fused=None), dict(fused=True, block_n=512), dict(fused=False, pdl=True),
                  dict(fused=False, pdl=True, block_n=256), dict(fused=False, pdl=False)]
    for strategy in strategies:
        for dtype in dtypes:
            slots = [(i * 7) % 9 - 1 for i in range(40)]
            for kw in decode_kws:
                if kw["fused"] and strategy != "triton":
                    continue  # csgmv merges one adapter's tokens into multi-token chunks: no fused kernel
                cases.append((strategy, dtype, [1] * 40, slots, "decode", kw))
            cases.append((strategy, dtype, [300, 1, 700, 45], [0, -1, 3, 0], "prefill", dict(fused=None)))
            cases.append((strategy, dtype, [300, 1, 700, 45], [0, -1, 3, 0], "prefill", dict(pdl=False)))
    all_ok, n_checked = True, 0
    for strategy in strategies:  # the prefill path: delta written, base GEMM accumulated into it
        for dtype in dtypes:
            for K, slices in (shapes if dtype == torch.bfloat16 else shapes[:1]):
                # the shrink's K splits: planes of partial sums, atomics; the expand a programmatic
                # dependent of the shrink (the launcher's default on sm90+) or not
                for partials, pdl in ((True, None), (False, None), (True, False)):
                    ok, err = check_linear(strategy, dtype, [300, 1, 700, 45, 20], [0, -1, 3, 0, -1],
                                           [16, 8, 1, 16, 0, 5, 16, 12], K, slices, 16, partials, pdl)
                    n_checked += 1
                    all_ok &= ok
                    if not ok:
                        print(f"FAIL lora_linear {strategy} {dtype} partials={partials} pdl={pdl} K={K} {slices}: "
                              f"max rel err {err:.2e}")
    for strategy, dtype, lens, slots, shape, kw in cases:
        # bf16 (the serving dtype) on every shape; fp16 and fp32 on qkv (each shape compiles anew)
        for K, slices in (shapes if dtype == torch.bfloat16 else shapes[:1]):
            ok, err = check(strategy, dtype, lens, slots, [16, 8, 1, 16, 0, 5, 16, 12], K, slices, 16, kw)
            n_checked += 1
            all_ok &= ok
            if not ok:
                print(f"FAIL {strategy} {dtype} {shape} {kw} K={K} {slices}: max rel err {err:.2e}")
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


def interleaved_times(fns: list[Callable[[], None]], reps: int = 7, scrub_mb: int = 256) -> list[float]:
    """Seconds per call of each fn, one CUDA graph each, replayed round robin reps times (medians): the
    clock drift of a long run (a 5 ms GEMM's time moved by 5-10 % between rows) hits all of them alike.
    Before every timed replay an untimed read of scrub_mb MB (0 = none) leaves the L2 clean: otherwise a
    graph pays for the previous one's dirty lines (a 67 MB copy cost the next variant ~4 µs,
    and the first lora_linear column of each prefill row, timed after the add-after order's write of
    y, read 1-3 points of the GEMM higher than the same code in the next columns)."""
    if DEV.type == "cpu":
        return [graph_time([f]) for f in fns]
    scrub = None
    if scrub_mb:
        junk = torch.empty(scrub_mb * 2**19, device=DEV, dtype=torch.bfloat16)
        fns = [lambda: junk.sum(dtype=torch.float32)] + list(fns)
    graphs = []
    for f in fns:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            f()  # warm-up: compiles, allocates
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        g.replay()
        graphs.append(g)
    if scrub_mb:
        scrub, graphs = graphs[0], graphs[1:]
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(reps):
        for g, ts in zip(graphs, times):
            if scrub is not None:
                scrub.replay()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
    return [sorted(ts)[len(ts) // 2] for ts in times]


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
        self.W: torch.Tensor | None = None  # [OUT, K], made by base_fn (prefill only)

    def weight(self) -> torch.Tensor:
        if self.W is None:
            self.W = torch.randn(self.offs[-1], self.K, device=DEV, dtype=torch.bfloat16) * 0.02
        return self.W

    def base_fn(self, accumulate: bool = False) -> Callable[[], None]:
        """x @ Wᵀ into y through cuBLAS; accumulate: y += x @ Wᵀ (beta = 1, C read in the epilogue)."""
        W = self.weight()
        if accumulate:
            return lambda: self.y.addmm_(self.x, W.t())
        return lambda: torch.mm(self.x, W.t(), out=self.y)

    def linear_fn(self, segs: LoRASegments, linear: Callable = lora_linear, **kw) -> Callable[[], None]:
        """The engine's prefill path: the whole wrapped projection through kernels/lora_linear.py
        (kw: its split_k / partials overrides; linear: an earlier package's lora_linear)."""
        W = self.weight()
        return lambda: linear(self.x, W, self.A, self.B, segs, self.ranks, self.offs, **kw)

    def add_after_fn(self, segs: LoRASegments) -> Callable[[], None]:
        """The order before lora_linear: the base GEMM, then lora_apply reads y, adds, writes it back."""
        base = self.base_fn()

        def fn() -> None:
            base()
            lora_apply(self.y, self.x, self.A, self.B, segs, self.ranks, self.offs)
        return fn

    def kernel_fn(self, segs: LoRASegments, apply: Callable = lora_apply) -> Callable[[], None]:
        def fn() -> None:
            apply(self.y, self.x, self.A, self.B, segs, self.ranks, self.offs)
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
    # lora_linear's ways of writing the delta (triton strategy), then the csgmv strategies' default path
    # (split_k, partials and pdl shape the cuBLAS order only: where lora_linear picks lora_gemm, 4096-8192
    # tokens, those four columns time the same code; the last two pin each path)
    variants = {"K split atomic": dict(partials=False), "K split planes": dict(partials=True),
                "no K split": dict(split_k=1), "no PDL": dict(pdl=False), "cuBLAS order": dict(gemm="cublas"),
                "Triton GEMM": dict(gemm="triton")}
    head = ("| proj | T | D | base µs | base, C read (beta=1) µs | add-after LoRA µs (% base) | "
            + " | ".join(f"{v} LoRA µs (% base)" for v in variants)
            + " | csgmv16 LoRA µs (% base) | csgmv64 LoRA µs (% base)"
            + "".join(f" | before ({b[0]}) LoRA µs (% base)" for b in BEFORE)
            + " | base again µs (% base) | torch LoRA µs (% base) | TFLOP/s (best) |")
    lines += ["Prefill (sequences of up to 4096 tokens, rank 16, bf16; base = x @ Wᵀ through cuBLAS; LoRA µs = "
              "the wrapped projection's time minus the base's; kernels/lora_linear.py with the shrink's K "
              "splits (launcher's count) atomic or in planes, or no K split (triton strategy), or pinned to "
              "the cuBLAS order or the Triton GEMM (lora_gemm); csgmv: lora_linear's default; add-after: the "
              "GEMM, then lora_apply; base again: the same cuBLAS GEMM timed last in the same interleaved "
              "run, how far two identical GEMMs differ, the noise under every % here):", "", head,
              "|" + "---|" * (head.count("|") - 1)]
    rows = [(name, K, slices, T, D) for name, (K, slices) in LLAMA_8B.items() for T, D in PREFILL
            if not args.prefill_t or T in args.prefill_t]
    for name, K, slices, T, D in rows:
        if time.time() - t_start > args.prefill_share * args.budget_s:  # leave the rest of the budget to decode
            lines.append(f"(prefill's share of the budget spent: stopped before {name} T={T} D={D})")
            break
        p = Proj(K, slices, T)
        its = layouts(T, D, max(1, T // PREFILL_SEQ))[:1]
        segs = {strategy: make_segments(strategy, *its[0]) for strategy in STRATEGIES}
        fns = ([p.base_fn(), p.base_fn(accumulate=True), p.add_after_fn(segs["triton"])]
               + [p.linear_fn(segs["triton"], **kw) for kw in variants.values()]
               + [p.linear_fn(segs[strategy]) for strategy in ("csgmv16", "csgmv64")]
               + [p.linear_fn(segs["triton"], b[2]) for b in BEFORE] + [p.base_fn()])
        base, acc, *lin, again = interleaved_times(fns)
        flops = 2 * T * RANK * (p.n * K + p.offs[-1])
        tt = math.nan if args.skip_torch else graph_time([p.torch_fn(*its[0])])

        def cell(t: float) -> str:
            return f"{(t - base) * 1e6:.1f} ({100 * (t - base) / base:.1f} %)"
        best = min(lin[1:]) - base
        row = (f"| {name} | {T} | {D} | {base * 1e6:.1f} | {acc * 1e6:.1f} | "
               + " | ".join(cell(t) for t in lin) + f" | {again * 1e6:.1f} ({100 * again / base:.1f} %)"
               + f" | {tt * 1e6:.1f} ({100 * tt / base:.1f} %) | {flops / max(best, 1e-9) / 1e12:.1f} |")
        lines.append(row)
        print(row, flush=True)
        del p
    head = ("| proj | T | D | " + " | ".join(f"{s} µs | {s} adapter GB/s (% copy)" for s in STRATEGIES)
            + " | triton b2b µs (% copy)" + "".join(f" | triton, before ({b[0]}) µs (% copy)" for b in BEFORE)
            + " | same bytes read µs (% copy) | torch µs | TFLOP/s (best) |")
    lines += ["", "Decode (lora_apply, rank 16, bf16; CUDA-graph replay, weights rotated past the L2"
              + ("; before = the --before-pkg kernels, same run" if BEFORE else "")
              + "; same bytes read: one torch sum over a buffer of the adapter bytes, a read-only floor of "
              "that size with its own launch, ramp and tail):", "",
              head, "|" + "---|" * (head.count("|") - 1)]
    print(lines[0], flush=True)
    for T, D in DECODE[:args.decode_rows]:  # most telling first, should the budget run out
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
            fns = [p.kernel_fn(make_segments("triton", *it)) for it in its]
            tb = graph_time(fns * triton.cdiv(8, len(fns)))  # >= 8 applications back to back per graph
            cells.append(f"{tb * 1e6:.1f} ({100 * n_bytes / tb / bw:.0f} %)")
            for b in BEFORE:
                to = graph_time([p.kernel_fn(make_segments("triton", *it), b[1]) for it in its])
                cells.append(f"{to * 1e6:.1f} ({100 * n_bytes / to / bw:.0f} %)")
            rd = torch.empty(n_bytes // 2, device=DEV, dtype=torch.bfloat16)  # read only: contents do not matter
            tr = graph_time([lambda: rd.sum(dtype=torch.float32)])
            cells.append(f"{tr * 1e6:.1f} ({100 * n_bytes / tr / bw:.0f} %)")
            del rd
            tt = math.nan if args.skip_torch else graph_time([p.torch_fn(*it) for it in its])
            row = f"| {name} | {T} | {D} | " + " | ".join(cells) + f" | {tt * 1e6:.1f} | {flops / best / 1e12:.2f} |"
            lines.append(row)
            print(row, flush=True)
            del p
    return lines


# lora_apply, one-token segments: (fused, block_k, block_n, cols_per_prog, num_warps, num_stages, pdl, split_k);
# None = the launchers' choice. Unfused: block_n is the PDL expand's column block, split_k the shrink's.
APPLY_DECODE = [(None,) * 8, (True,) + (None,) * 7, (True, None, None, 16384) + (None,) * 4,
                (False,) + (None,) * 5 + (False, None), (False,) + (None,) * 5 + (True, None),
                (False, None, 256) + (None,) * 3 + (True, None), (False,) + (None,) * 5 + (True, 1)]
TUNE_DECODE = [("o", 256, 256), ("down", 256, 256), ("qkv", 256, 256), ("gate_up", 256, 256),
               ("o", 64, 64), ("down", 64, 64), ("qkv", 64, 64), ("gate_up", 64, 64)]
# where the time of a prefill delta goes: a memset of y, lora_shrink, lora_expand (write) apart
TUNE_PREFILL = [("o", 16384, 1)]


def tiles(cfg: tuple) -> str:
    return "/".join("-" if c is None else str(c) for c in cfg)


def tune(args: argparse.Namespace, bw: float) -> list[str]:
    """Other tile and path choices than the launchers' (marked *), at the shapes that miss the targets."""
    lines = ["", "Tile and path choices (triton strategy; * = the launchers' default). apply: fused/"
             "block_k/block_n/cols_per_prog/warps/stages/pdl/split_k; shrink, expand (write): the launchers' tiles:", "",
             "| op | proj | T | D | tiles | µs | GB/s moved (% copy) |", "|---|---|---|---|---|---|---|"]
    t0 = time.time()

    def emit(op: str, name: str, T: int, D: int, cfg: tuple, t: float, nbytes: float) -> None:
        star = "*" if all(c is None for c in cfg) else ""
        line = (f"| {op}{star} | {name} | {T} | {D} | {tiles(cfg)} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} "
                f"({100 * nbytes / t / bw:.0f} %) |")
        lines.append(line)
        print(line, flush=True)

    def timed(fns: list[Callable[[], None]]) -> float:
        try:
            return graph_time(fns)
        except Exception as e:  # a variant that fails to compile must not cost the rest of the run
            print(f"variant failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return math.nan

    def out_of_budget(name: str, T: int) -> bool:
        """The tune budget is spent: say so in the table; no shape starts after it."""
        if time.time() - t0 <= args.tune_budget_s:
            return False
        lines.append(f"(tune budget of {args.tune_budget_s} s spent: stopped before {name} T={T})")
        return True

    for name, T, D in TUNE_DECODE:
        if out_of_budget(name, T):
            return lines
        K, slices = LLAMA_8B[name]
        p = Proj(K, slices, T)
        segs = [make_segments("triton", *it) for it in layouts(T, D, T)]
        nbytes = D * (p.n * RANK * K + p.offs[-1] * RANK) * 2
        for cfg in APPLY_DECODE:
            fu, bk, bn, cp, w, st, pdl, sk = cfg
            kw = dict(fused=fu, block_k=bk, block_n=bn, cols_per_prog=cp, num_warps=w, num_stages=st, pdl=pdl,
                      split_k=sk)
            t = timed([lambda sg=sg: lora_apply(p.y, p.x, p.A, p.B, sg, p.ranks, p.offs, **kw) for sg in segs])
            emit("apply", name, T, D, cfg, t, nbytes)
        p = None  # frees the buffers before the next shape
    for name, T, D in TUNE_PREFILL:
        if out_of_budget(name, T):
            return lines
        K, slices = LLAMA_8B[name]
        p = Proj(K, slices, T)
        seg = make_segments("triton", *layouts(T, D, max(1, T // PREFILL_SEQ))[0])
        emit("memset y", name, T, D, ("",), timed([lambda: p.y.zero_()]), p.y.numel() * 2)
        emit("shrink", name, T, D, (None,), timed([lambda: lora_shrink(p.x, p.A, seg, p.ranks)]), p.x.numel() * 2)
        h = lora_shrink(p.x, p.A, seg, p.ranks)
        t = timed([lambda: lora_expand(p.y, h, p.B, seg, p.ranks, p.offs, write=True)])
        emit("expand (write)", name, T, D, (None,), t, p.y.numel() * 2)
        h = None
        p = None
    return lines


def main() -> None:
    global SLOTS, DECODE, PREFILL, PREFILL_SEQ, TUNE_DECODE, TUNE_PREFILL, APPLY_DECODE, BEFORE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing new rows after this long")
    ap.add_argument("--out", help="also write the tables to this file")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-tune", action="store_true", help="no table of other tile choices")
    ap.add_argument("--tune-first", action="store_true", help="time the tile choices before the main tables")
    ap.add_argument("--tune-budget-s", type=float, default=150.0, help="stop tuning new shapes after this long")
    ap.add_argument("--skip-torch", action="store_true", help="no timing of the torch reference")
    ap.add_argument("--decode-rows", type=int, default=len(DECODE), help="time only the first N (T, D) decode rows")
    ap.add_argument("--prefill-share", type=float, default=0.4, help="share of --budget-s for the prefill rows")
    ap.add_argument("--prefill-t", type=lambda v: [int(t) for t in v.split(",")], default=None,
                    help="time only these prefill token counts (comma-separated)")
    ap.add_argument("--before-pkg", help="earlier kernels packages (importable names, comma-separated) for the "
                    "'before' columns")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: check the script itself (CPU + interpreter)")
    args = ap.parse_args()
    if args.before_pkg:
        BEFORE = [(pkg, importlib.import_module(f"{pkg}.lora_apply").lora_apply,
                   importlib.import_module(f"{pkg}.lora_linear").lora_linear) for pkg in args.before_pkg.split(",")]
    if args.smoke:
        SLOTS, DECODE, PREFILL, PREFILL_SEQ = 8, [(1, 1), (4, 2), (8, 8)], [(64, 1), (128, 2)], 64
        TUNE_DECODE, TUNE_PREFILL = [("o", 8, 8)], [("qkv", 128, 1)]
        APPLY_DECODE = [APPLY_DECODE[0], APPLY_DECODE[4]]
        for name, (K, slices) in list(LLAMA_8B.items()):
            LLAMA_8B[name] = (K // 64, [s // 64 for s in slices])
    gpu = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter)"
    print(f"{gpu} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    ok = True if args.skip_check else run_checks(args.smoke)
    tuned = tune(args, copy_bandwidth()) if args.tune_first and not args.skip_tune else []
    lines = bench(args) + tuned
    if not args.skip_tune and not args.tune_first:
        lines += tune(args, copy_bandwidth())
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
