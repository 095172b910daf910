"""GPU check of issue 7's engine parts on one CUDA device, in one short run.

1. The Triton paged-attention decode kernel against its torch twin (kernels/reference.py) on the GPU:
   Llama-3.1-8B heads (32 q / 8 kv, head_dim 128) and SmolLM2 heads (9 / 3, 64), bf16/fp16/fp32,
   contexts that are not multiples of the block size, split-K 1 and auto.
2. Attention alone, one layer of the 8B shape: the kernel vs the twin (gather + SDPA), each
   replayed from a CUDA graph (device time, no launch cost), CUDA events.
3. The engine (SmolLM2-135M architecture, random weights): greedy tokens with CUDA graphs equal to
   the eager engine's (fp32), and the decode step time eager vs graphs (bf16, batch 1/8/64).

    python benchmarks/gpu_engine_check.py --tokenizer DIR [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import engine_for, make_model  # noqa: E402

from appliance.engine.request import SamplingParams  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.paged_attention import paged_attention_decode  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def kernel_case(h: int, kvh: int, d: int, lens: list[int], dtype: torch.dtype, bs: int = 16) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(0)
    need = [-(-n // bs) for n in lens]
    nblocks = sum(need) + 1
    kc = torch.randn(nblocks, bs, kvh, d, device="cuda", generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, kvh, d, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(nblocks, device="cuda", generator=g).to(torch.int32)
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32, device="cuda")
    o = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[o:o + n]
        o += n
    q = torch.randn(len(lens), h, d, device="cuda", generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device="cuda")


def kernels_section(res: dict) -> None:
    rows = []
    for (h, kvh, d) in ((32, 8, 128), (9, 3, 64)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for splits in (1, 4):
                q, kc, vc, bt, lens = kernel_case(h, kvh, d, [1, 17, 1000, 1040, 333], dtype)
                got = paged_attention_decode(q, kc, vc, bt, lens, d ** -0.5, num_splits=splits)
                want = ref.paged_attention_decode(q.float(), kc.float(), vc.float(), bt, lens, d ** -0.5)
                err = (got.float() - want).abs().max().item()
                rows.append({"heads": f"{h}/{kvh}x{d}", "dtype": str(dtype)[6:], "splits": splits,
                             "max_err": err, "ok": err <= TOL[dtype]})
    res["kernel_parity"] = rows
    bad = [r for r in rows if not r["ok"]]
    print(f"paged decode kernel vs twin on cuda: {len(rows) - len(bad)}/{len(rows)} cases within tolerance")
    for r in bad:
        print("  FAIL", r)


def time_cuda(fn, reps: int = 20) -> float:
    """Device time of fn, replayed from a CUDA graph so the host's launch cost is not measured."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps  # ms


def attention_bench(res: dict) -> None:
    rows = []
    bound = 8192  # as in a graph of the 8B shape (model.max_model_len 8192)
    for b, ctx in ((64, 1024), (8, 1024), (1, 1024), (1, 4096)):
        q, kc, vc, bt, lens = kernel_case(32, 8, 128, [ctx] * b, torch.bfloat16)
        splits = max(1, min(64, -(-bound // 512))) if 4 * b * 8 <= 132 else 1  # ModelRunner.decode_splits
        t_k = time_cuda(lambda: paged_attention_decode(q, kc, vc, bt, lens, 0.088, num_splits=splits,
                                                       max_len_bound=bound))
        t_k1 = time_cuda(lambda: paged_attention_decode(q, kc, vc, bt, lens, 0.088))
        t_t = time_cuda(lambda: ref.paged_attention_decode(q, kc, vc, bt, lens, 0.088, max_len=ctx))
        kv_bytes = 2 * b * ctx * 8 * 128 * 2
        rows.append({"batch": b, "context": ctx, "splits": splits, "triton_us": round(t_k * 1e3, 1),
                     "triton_1split_us": round(t_k1 * 1e3, 1), "torch_twin_us": round(t_t * 1e3, 1),
                     "kv_gb_s": round(kv_bytes / (t_k * 1e-3) / 1e9)})
    res["attention_layer"] = rows
    print("\none 8B-shape layer's decode attention (bf16, 32 q / 8 kv heads, d 128), microseconds")
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} {'triton':>8} {'1 split':>8} {'twin':>8} {'KV GB/s':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>5} {r['splits']:>6} {r['triton_us']:>8} {r['triton_1split_us']:>8} "
              f"{r['torch_twin_us']:>8} {r['kv_gb_s']:>8}")


def generate(eng, prompts: list[list[int]], lens: list[int]) -> dict[str, list[int]]:
    for i, (p, n) in enumerate(zip(prompts, lens)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def decode_step_ms(eng, prompts: list[list[int]], steps: int = 10) -> float:
    for i, p in enumerate(prompts):
        eng.add_request(f"d{i}", p, SamplingParams(max_tokens=steps + len(prompts) + 8, temperature=0.0,
                                                   ignore_eos=True))
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(o.request_id for o in eng.step())
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for i in range(len(prompts)):
        eng.abort(f"d{i}")
    return statistics.median(times) * 1e3


def engine_section(res: dict, tokenizer: Path) -> None:
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        make_model(d, tokenizer)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 49000, (int(n),), generator=g).tolist() for n in torch.randint(20, 200, (64,), generator=g)]
        lens = [4 + (i * 7) % 29 for i in range(12)]  # the batch shrinks over the graph sizes
        graphs = engine_for(d, "float32", 16)
        assert graphs.runner.static_decode is not None and graphs.runner.static_decode.capture
        eager = engine_for(d, "float32", 16, "engine.enforce_eager=true")
        a, b = generate(graphs, prompts[:12], lens), generate(eager, prompts[:12], lens)
        same = sum(a[k] == b[k] for k in b)
        res["graphs_vs_eager_fp32_identical"] = f"{same}/12"
        print(f"\nfp32 greedy, CUDA graphs vs eager engine: {same}/12 requests identical ({sum(lens)} tokens)")
        del graphs, eager
        torch.cuda.empty_cache()
        rows = []
        for mode in ("eager", "graphs"):
            extra = ("engine.enforce_eager=true",) if mode == "eager" else ()
            eng = engine_for(d, "bfloat16", 64, *extra)
            for bsz in (1, 8, 64):
                rows.append({"mode": mode, "batch": bsz, "step_ms": round(decode_step_ms(eng, prompts[:bsz]), 3)})
            del eng
            torch.cuda.empty_cache()
        res["smollm2_decode_step"] = rows
        print("SmolLM2-135M shape, bf16, decode step ms (median of 10):")
        for r in rows:
            print(f"  {r['mode']:>6} batch {r['batch']:>3}: {r['step_ms']:8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    res: dict = {}
    for section in (kernels_section, attention_bench, lambda r: engine_section(r, args.tokenizer)):
        try:
            section(res)
        except Exception as e:  # noqa: BLE001 - report and go on to the next section
            import traceback

            traceback.print_exc()
            res.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
