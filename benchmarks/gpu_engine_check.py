"""GPU check of issue 7's engine parts on one CUDA device, in one short run.

1. The Triton paged-attention decode kernel against its torch twin (kernels/reference.py) on the GPU:
   Llama-3.1-8B heads (32 q / 8 kv, head_dim 128) and SmolLM2 heads (9 / 3, 64), bf16/fp16/fp32,
   contexts that are not multiples of the block size, split-K 1 and auto.
2. Attention alone, one layer of the 8B shape: the kernel vs the twin (gather + SDPA), each
   replayed from a CUDA graph (device time, no launch cost), CUDA events.
3. The fused elementwise kernels (engine.fused_kernels: rms_norm.py, rope_kv.py, silu_mul.py) against
   their twins on the GPU at the 8B and SmolLM2 shapes, decode and prefill row counts, and their device
   time against the torch ops they replace (graph-replayed).
4. The engine (SmolLM2-135M architecture, random weights): greedy tokens with CUDA graphs and the fused
   kernels equal to the eager engine's with the torch ops (fp32), base and with 4 LoRA adapters
   (lora.backend triton); the decode step with graphs, fused kernels off vs on (bf16, batch 1/8/64).
5. Async scheduling (engine/async_step.py) on vs off, both with graphs: identical tokens (fp32, LoRA,
   greedy, seeded sampling, stop tokens), and the decode step back to back vs serial.
6. lora.decode_side_stream on vs off with graphs: identical greedy tokens (fp32, LoRA).
7. Piecewise CUDA graphs (engine/piecewise.py) vs eager steps with prefills: identical greedy tokens
   (fp32, base and 4 LoRA adapters, requests arriving two a step beside running decodes), and how
   many steps took the piecewise path.

    python benchmarks/gpu_engine_check.py --tokenizer DIR [--out FILE.json]
        [--sections kernels attention fused engine async aside piecewise]
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
from appliance.models.attention import write_kv  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.paged_attention import paged_attention_decode  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402
from kernels.rope_kv import rope_write_kv  # noqa: E402
from kernels.silu_mul import silu_mul  # noqa: E402

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


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (1 + |want|): one rounding step of the dtype at any magnitude."""
    g, w = got.float().nan_to_num(), want.float().nan_to_num()
    return ((g - w).abs() / (1 + w.abs())).max().item()


def fused_section(res: dict) -> None:
    """The fused kernels against their twins (same dtype) and their device time against the torch ops.
    Errors are relative (rel_err), within 2x TOL: exp/rsqrt approximations may move a result one
    rounding step of the dtype."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for T, H in ((64, 4096), (8192, 4096), (7, 576)):
            x, r, w = rn(T, H, dtype=dtype, scale=2.0), rn(T, H, dtype=dtype), rn(H, dtype=dtype)
            out, s = rms_norm(x, w, 1e-5, r)
            want, want_s = ref.rms_norm(x, w, 1e-5, r)
            err = rel_err(out, want)
            rows.append({"op": "add+rms_norm", "shape": f"{T}x{H}", "dtype": str(dtype)[6:], "max_err": err,
                         "residual_equal": bool(torch.equal(s, want_s)),
                         "ok": err <= TOL[dtype] * 2 and torch.equal(s, want_s)})
        for T, h, kvh, d in ((64, 32, 8, 128), (3000, 32, 8, 128), (17, 9, 3, 64)):
            inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d))
            f = torch.outer(torch.arange(8192, device=dev, dtype=torch.float64), inv).float()
            cos, sin = f.cos(), f.sin()
            qkv = rn(T, (h + 2 * kvh) * d, dtype=dtype)
            pos = torch.randint(0, 8192, (T,), device=dev, generator=g)
            nblk = -(-T // 16) + 4
            slots = torch.randperm(nblk * 16, device=dev, generator=g)[:T]
            kc = torch.full((nblk, 16, kvh, d), float("nan"), dtype=dtype, device=dev)
            vc = torch.full_like(kc, float("nan"))
            got_qkv, got_k, got_v = qkv.clone(), kc.clone(), vc.clone()
            rope_write_kv(got_qkv, pos, cos, sin, got_k, got_v, slots, h, kvh)
            ref.rope_write_kv(qkv, pos, cos, sin, kc, vc, slots, h, kvh)
            err = max(rel_err(got_qkv, qkv), rel_err(got_k, kc))
            same_slots = bool(torch.equal(got_k.isnan(), kc.isnan())) and bool(torch.equal(got_v.isnan(), vc.isnan()))
            v_equal = bool(torch.equal(got_v.nan_to_num(), vc.nan_to_num()))
            rows.append({"op": "rope+kv_write", "shape": f"{T}x{h}/{kvh}x{d}", "dtype": str(dtype)[6:],
                         "max_err": err, "ok": err <= TOL[dtype] * 2 and same_slots and v_equal})
        for T, inter in ((64, 14336), (2048, 14336), (5, 1536)):
            gu = rn(T, 2 * inter, dtype=dtype, scale=3.0)
            err = rel_err(silu_mul(gu), ref.silu_mul(gu))
            rows.append({"op": "silu_mul", "shape": f"{T}x{inter}", "dtype": str(dtype)[6:], "max_err": err,
                         "ok": err <= TOL[dtype] * 2})
    res["fused_parity"] = rows
    bad = [r for r in rows if not r["ok"]]
    print(f"fused kernels vs twins on cuda: {len(rows) - len(bad)}/{len(rows)} cases within tolerance")
    for r in bad:
        print("  FAIL", r)

    # Device time at the 8B shape (bf16), per layer call, graph-replayed: kernel vs the torch ops.
    timing = []
    for T in (64, 2048):
        x, r, w = rn(T, 4096, dtype=torch.bfloat16), rn(T, 4096, dtype=torch.bfloat16), rn(4096, dtype=torch.bfloat16)
        timing.append(("add+rms_norm", T, time_cuda(lambda: rms_norm(x, w, 1e-5, r)),
                       time_cuda(lambda: ref.rms_norm(x, w, 1e-5, r))))
        inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=dev, dtype=torch.float64) / 128))
        f = torch.outer(torch.arange(8192, device=dev, dtype=torch.float64), inv).float()
        cos, sin = f.cos(), f.sin()
        qkv = rn(T, 48 * 128, dtype=torch.bfloat16)
        pos = torch.randint(0, 8192, (T,), device=dev, generator=g)
        slots = torch.randperm(T + 64, device=dev, generator=g)[:T]
        kc = torch.zeros(-(-(T + 64) // 16), 16, 8, 128, dtype=torch.bfloat16, device=dev)
        vc = torch.zeros_like(kc)

        def torch_rope() -> None:  # the model's torch path: views, table gathers, rotate, index_put
            q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
            c, s_ = cos[pos][:, None, :], sin[pos][:, None, :]
            ref.rope_rotate(q.view(T, 32, 128), c, s_)
            write_kv(ref.rope_rotate(k.view(T, 8, 128), c, s_), v.view(T, 8, 128), kc, vc, slots)

        timing.append(("rope+kv_write", T, time_cuda(lambda: rope_write_kv(qkv, pos, cos, sin, kc, vc, slots, 32, 8)),
                       time_cuda(torch_rope)))
        gu = rn(T, 2 * 14336, dtype=torch.bfloat16)
        timing.append(("silu_mul", T, time_cuda(lambda: silu_mul(gu)), time_cuda(lambda: ref.silu_mul(gu))))
    res["fused_timing_us"] = [{"op": o, "tokens": T, "fused_us": round(a * 1e3, 1), "torch_us": round(b * 1e3, 1)}
                              for o, T, a, b in timing]
    print("\nfused kernels vs torch ops, 8B shape, bf16, device us per call (graph-replayed)")
    for o, T, a, b in timing:
        print(f"  {o:>14} T={T:>5}: fused {a * 1e3:7.1f}  torch {b * 1e3:7.1f}")


def generate(eng, prompts: list[list[int]], lens: list[int],
             adapters: "list[str | None] | None" = None) -> dict[str, list[int]]:
    for i, (p, n) in enumerate(zip(prompts, lens)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                        adapter=None if adapters is None else adapters[i])
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


ALL_7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def small_model(td: str, tokenizer: Path, seed: int) -> tuple[Path, list[list[int]]]:
    """The SmolLM2-135M architecture with random weights in td/model, and 64 random prompts of 20 to
    200 tokens."""
    d = Path(td) / "model"
    d.mkdir()
    make_model(d, tokenizer)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 200, (64,), generator=g)
    return d, [torch.randint(3, 49000, (int(n),), generator=g).tolist() for n in lens]


def rank8_adapters(root: Path, model_dir: Path) -> dict[str, Path]:
    """4 rank-8 adapters on all 7 projections (fp32) under root: name -> dir."""
    from appliance.bench.adapters import make_adapters
    from appliance.models.llama import ModelArgs
    from appliance.models.weights import read_hf_config

    return make_adapters(root, ModelArgs.from_hf_config(read_hf_config(model_dir)), 8, 4, ALL_7, 0.05,
                         torch.float32, torch.device("cuda"), progress=False)


def lora_engine(d: Path, adapters: "dict[str, Path]", *extra: str, backend: str = "triton"):
    """An fp32 engine on the model in d with lora.backend `backend` and `adapters` loaded (4 slots)."""
    root = next(iter(adapters.values())).parent
    eng = engine_for(d, "float32", 16, "lora.enabled=true", f"lora.adapter_roots=[{root}]", "lora.max_lora_rank=8",
                     "lora.max_loras_per_batch=4", f"lora.backend={backend}", *extra)
    for name, path in adapters.items():
        eng.lora.load(name, str(path))
    return eng


def adapter_keys(names: "list[str]") -> "list[str | None]":
    """The adapter of each of 12 requests: the 4 adapters on 8 of them, requests 4, 8, 9, 10 base (the
    longest are base, so the last decode steps replay the graphs without LoRA launches)."""
    return [None if i in (4, 8, 9, 10) else names[i % 4] for i in range(12)]


def engine_section(res: dict, tokenizer: Path) -> None:
    with tempfile.TemporaryDirectory() as td:
        d, prompts = small_model(td, tokenizer, 1)
        lens = [4 + (i * 7) % 29 for i in range(12)]  # the batch shrinks over the graph sizes
        # Graphs + fused kernels (the cuda defaults) against the eager engine on the torch ops.
        graphs = engine_for(d, "float32", 16)
        assert graphs.runner.static_decode is not None and graphs.runner.static_decode.capture
        assert graphs.runner.fused_kernels == "triton"
        eager = engine_for(d, "float32", 16, "engine.enforce_eager=true", "engine.fused_kernels=torch")
        a, b = generate(graphs, prompts[:12], lens), generate(eager, prompts[:12], lens)
        same = sum(a[k] == b[k] for k in b)
        res["graphs_fused_vs_eager_torch_fp32_identical"] = f"{same}/12"
        print(f"\nfp32 greedy, CUDA graphs + fused kernels vs eager engine + torch ops: {same}/12 requests "
              f"identical ({sum(lens)} tokens)")
        del graphs, eager
        torch.cuda.empty_cache()
        # The same with 4 LoRA adapters (rank 8, all 7 projections) on 8 requests, 4 base.
        adapters = rank8_adapters(Path(td) / "adapters", d)
        keys = adapter_keys(list(adapters))
        toks = []
        for extra in ((), ("engine.enforce_eager=true", "engine.fused_kernels=torch")):
            eng = lora_engine(d, adapters, *extra)
            toks.append(generate(eng, prompts[:12], lens, keys))
            del eng
            torch.cuda.empty_cache()
        same = sum(toks[0][k] == toks[1][k] for k in toks[1])
        res["lora_graphs_fused_vs_eager_torch_fp32_identical"] = f"{same}/12"
        print(f"fp32 greedy with 4 LoRA adapters (triton), graphs + fused vs eager + torch ops: {same}/12 identical")
        rows = []
        for fused in ("torch", "triton"):
            eng = engine_for(d, "bfloat16", 64, f"engine.fused_kernels={fused}")
            for bsz in (1, 8, 64):
                rows.append({"fused_kernels": fused, "batch": bsz,
                             "step_ms": round(decode_step_ms(eng, prompts[:bsz]), 3)})
            del eng
            torch.cuda.empty_cache()
        res["smollm2_decode_step_graphs"] = rows
        print("SmolLM2-135M shape, bf16, CUDA graphs, decode step ms (median of 10):")
        for r in rows:
            print(f"  fused_kernels={r['fused_kernels']:>6} batch {r['batch']:>3}: {r['step_ms']:8.3f}")


def run_params(eng, prompts: list[list[int]], params: list[SamplingParams],
               adapters: "list[str | None]") -> dict[str, tuple[list[int], str]]:
    """id -> (token ids, finish reason) of every request, all submitted at once."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp, adapter=adapters[i])
    out: dict[str, tuple[list[int], str]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            ids, _ = out.get(o.request_id, ([], ""))
            out[o.request_id] = (ids + o.token_ids, o.finish_reason or "")
    return out


def async_section(res: dict, tokenizer: Path) -> None:
    """engine.async_scheduling on vs off, both with CUDA graphs (fp32, 4 LoRA adapters on 8 of 12
    requests): greedy and seeded sampling, stop tokens that end requests while their next step is
    already launched; then the SmolLM2 decode step back to back vs serial (bf16)."""
    from appliance.bench.offline import decode_step

    with tempfile.TemporaryDirectory() as td:
        d, prompts = small_model(td, tokenizer, 2)
        adapters = rank8_adapters(Path(td) / "adapters", d)
        keys = adapter_keys(list(adapters))

        def params(stop: "list[int]") -> list[SamplingParams]:
            out = []
            for i in range(12):
                n = 4 + (i * 7) % 29
                if i % 3 == 0:
                    out.append(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                elif i % 3 == 1:
                    out.append(SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True))
                else:
                    out.append(SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=stop))
            return out

        engines = {}
        for on in (False, True):
            engines[on] = lora_engine(d, adapters, f"engine.async_scheduling={str(on).lower()}")
            assert engines[on].async_scheduling is on and engines[on].runner.static_decode.capture
        first = run_params(engines[False], prompts[:12], params([]), keys)
        # A token each stop-token request produced at its third position ends it there the second time.
        stop = sorted({first[str(i)][0][2] for i in range(12) if i % 3 == 2 and len(first[str(i)][0]) > 3})
        want = run_params(engines[False], prompts[:12], params(stop), keys)
        got = run_params(engines[True], prompts[:12], params(stop), keys)
        same = sum(got[k] == want[k] for k in want)
        stopped = sum(r == "stop" for _, r in want.values())
        res["async_vs_sync_fp32_lora_identical"] = f"{same}/12"
        print(f"\nfp32, graphs, 4 LoRA adapters, greedy + seeded sampling + stop tokens ({stopped} ended on "
              f"a stop): async scheduling vs sync {same}/12 requests identical")
        del engines
        torch.cuda.empty_cache()
        rows = []
        for on in (False, True):
            eng = engine_for(d, "bfloat16", 64, f"engine.async_scheduling={str(on).lower()}")
            for bsz in (8, 64):
                r = decode_step(eng, prompts[:bsz], [None] * bsz, 16, 1.0, 0, ())
                rows.append({"async": on, "batch": bsz, "step_ms": r["step_ms"], "step_ms_serial": r["step_ms_serial"]})
            del eng
            torch.cuda.empty_cache()
        res["smollm2_decode_async"] = rows
        print("SmolLM2-135M shape, bf16, graphs: decode step ms, back to back (median of 3 blocks of 16) / serial "
              "(median of 16):")
        for r in rows:
            print(f"  async {str(r['async']):>5} batch {r['batch']:>3}: {r['step_ms']:7.3f} / {r['step_ms_serial']:7.3f}")


def aside_section(res: dict, tokenizer: Path) -> None:
    """lora.decode_side_stream on vs off, both with CUDA graphs (fp32, 4 LoRA adapters on 8 of 12
    requests, greedy): the side-stream fork and join captured in the decode graphs give the tokens of
    the single-stream step. Its speed: `appliance bench offline ... lora.decode_side_stream=true`."""
    with tempfile.TemporaryDirectory() as td:
        d, prompts = small_model(td, tokenizer, 3)
        adapters = rank8_adapters(Path(td) / "adapters", d)
        keys = adapter_keys(list(adapters))
        params = [SamplingParams(max_tokens=4 + (i * 7) % 29, temperature=0.0, ignore_eos=True) for i in range(12)]
        out = {}
        for on in (False, True):
            eng = lora_engine(d, adapters, f"lora.decode_side_stream={str(on).lower()}")
            assert (eng.lora.ctx.side_stream is not None) is on and eng.runner.static_decode.capture
            out[on] = run_params(eng, prompts[:12], params, keys)
            del eng
            torch.cuda.empty_cache()
        same = sum(out[True][k] == out[False][k] for k in out[False])
        res["decode_side_stream_vs_off_fp32_lora_identical"] = f"{same}/12"
        print(f"\nfp32, graphs, 4 LoRA adapters, greedy: lora.decode_side_stream on vs off {same}/12 identical")


def staggered(eng, prompts: list[list[int]], lens: list[int], adapters: "list[str | None]") -> dict[str, list[int]]:
    """Greedy; two requests join per step, so their prefills run beside the running decodes."""
    out: dict[str, list[int]] = {}
    i = 0
    while i < len(prompts) or eng.has_unfinished():
        for j in range(i, min(i + 2, len(prompts))):
            eng.add_request(str(j), prompts[j], SamplingParams(max_tokens=lens[j], temperature=0.0, ignore_eos=True),
                            adapter=adapters[j])
        i += 2
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def piecewise_section(res: dict, tokenizer: Path) -> None:
    """engine.piecewise_graph_tokens null (16..512, captured) vs [] (steps with prefills eager), decode
    graphs on in both: fp32 greedy tokens, base and with 4 LoRA adapters on 8 of 12 requests."""
    with tempfile.TemporaryDirectory() as td:
        d, prompts = small_model(td, tokenizer, 4)
        adapters = rank8_adapters(Path(td) / "adapters", d)
        lens = [4 + (i * 7) % 29 for i in range(12)]
        for case, keys in (("base", [None] * 12), ("lora", adapter_keys(list(adapters)))):
            out, steps = {}, 0
            for on in (True, False):
                eng = lora_engine(d, adapters, f"engine.piecewise_graph_tokens={'null' if on else '[]'}")
                pw = eng.runner.piecewise
                assert (pw is not None and pw.capture) is on
                if on:
                    real_run = pw.run

                    def counted(*a, _run=real_run, **kw):
                        nonlocal steps
                        steps += 1
                        return _run(*a, **kw)

                    pw.run = counted
                out[on] = staggered(eng, prompts[:12], lens, keys)
                del eng
                torch.cuda.empty_cache()
            same = sum(out[True][k] == out[False][k] for k in out[False])
            res[f"piecewise_vs_eager_fp32_{case}_identical"] = f"{same}/12"
            res[f"piecewise_steps_{case}"] = steps
            print(f"\nfp32, {case}: piecewise graphs vs eager steps with prefills {same}/12 requests identical "
                  f"({steps} piecewise steps)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None)
    names = ["kernels", "attention", "fused", "engine", "async", "aside", "piecewise"]
    ap.add_argument("--sections", nargs="+", default=names, choices=names)
    args = ap.parse_args()
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    res: dict = {}
    sections = {"kernels": kernels_section, "attention": attention_bench, "fused": fused_section,
                "engine": lambda r: engine_section(r, args.tokenizer),
                "async": lambda r: async_section(r, args.tokenizer),
                "aside": lambda r: aside_section(r, args.tokenizer),
                "piecewise": lambda r: piecewise_section(r, args.tokenizer)}
    for name in args.sections:
        try:
            sections[name](res)
        except Exception as e:  # noqa: BLE001 - report and go on to the next section
            import traceback

            traceback.print_exc()
            res.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
        if args.out:  # after every section: a timeout later keeps what was measured
            args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
