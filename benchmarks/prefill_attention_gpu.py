"""Prefill attention on one GPU (issues 32/35): the one-launch Triton kernel against today's path, one layer.

Today's path is `paged_attention` with backend torch's prefills (what every backend ran before the
kernel): SDPA per chunk, chunks over a cached context gathered and batched per ContextGroup. The new
path is backend triton: kernels/prefill_attention.py over PrefillTiles. Per case, at the 8B shape
(32 query / 8 KV heads, head_dim 128, bf16, 16-token blocks, blocks scattered over the cache, this
step's K/V written to it first as the model does):
  1. correctness: each path against the kernel's twin (reference.prefill_attention, fp32 on the same
     bf16 inputs): max abs error, asserted under 3e-2;
  2. device time per layer call, replayed from a CUDA graph (no host cost); eager time per call (20
     back to back, CUDA events: what a step pays when the host is the bottleneck); host time per call
     (the launches alone); kernels launched per call (torch profiler);
  3. a tile sweep of the kernel (rows per program x keys per iteration x warps x stages), device time.
The cases: the prefix-cache wave (64 chunks x 64 tokens, each over its own 1,024-token context),
8 x 128 tokens and 1 x 2,048 tokens and 1 x 128 tokens with no context. Prints a table last.

    python benchmarks/prefill_attention_gpu.py [--out FILE.json]
    TRITON_INTERPRET=1 python benchmarks/prefill_attention_gpu.py --small   # CPU smoke run: tiny shapes, timings meaningless
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_check import time_cuda  # noqa: E402
from appliance.models.attention import (AttentionMetadata, PrefillSeq, context_groups,  # noqa: E402
                                        paged_attention, write_kv)
from kernels import reference as ref  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402
from kernels.prefill_tiles import prefill_tiles  # noqa: E402

BS = 16
TOL = 3e-2  # bf16 against the fp32 twin
# name -> (context_len, q_len) per chunk
CASES = {
    "wave 64 x 64 over 1024": [(1024, 64)] * 64,
    "8 x 128, no context": [(0, 128)] * 8,
    "1 x 2048, no context": [(0, 2048)],
    "1 x 128, no context": [(0, 128)],
}
SMALL = {"wave 4 x 8 over 40": [(40, 8)] * 4, "2 x 16": [(0, 16)] * 2, "1 x 64": [(0, 64)], "1 x 16": [(0, 16)]}
# (rows per program, keys per iteration, warps, stages); the first is the launcher's default on bf16
TILES = [(128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3),
         (64, 32, 4, 3)]


def build(chunks: list[tuple[int, int]], h: int, kvh: int, d: int, dtype: torch.dtype, dev: torch.device) -> tuple:
    """q, k, v (views of one qkv buffer, as the model's), the caches holding every chunk's context and
    this step's K/V, and the chunk tuples (q_start, q_len, context_len, block table)."""
    g = torch.Generator(device=dev).manual_seed(0)
    need = [-(-(c + n) // BS) for c, n in chunks]
    nblocks = sum(need) + 1
    kc = torch.randn(nblocks, BS, kvh, d, device=dev, generator=g).to(dtype)
    vc = torch.randn(nblocks, BS, kvh, d, device=dev, generator=g).to(dtype)
    perm = torch.randperm(nblocks, device=dev, generator=g).tolist()
    tp = sum(n for _, n in chunks)
    qkv = torch.randn(tp, (h + 2 * kvh) * d, device=dev, generator=g).to(dtype)
    q = qkv[:, :h * d].view(tp, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(tp, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(tp, kvh, d)
    prefills, slots, o, q0 = [], [], 0, 0
    for (c, n), nb in zip(chunks, need):
        table = perm[o:o + nb]
        o += nb
        slots += [table[p // BS] * BS + p % BS for p in range(c, c + n)]
        prefills.append((q0, n, c, table))
        q0 += n
    write_kv(k, v, kc, vc, torch.tensor(slots, dtype=torch.long, device=dev))
    return q, k, v, kc, vc, prefills


def meta_for(prefills: list, backend: str, group: int, dev: torch.device) -> AttentionMetadata:
    """The step's metadata as ModelRunner.inputs builds it for `backend` (prefills only)."""
    torch_path = backend == "torch"
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=dev),
        prefills=[PrefillSeq(q0, n, c, torch.tensor(t, dtype=torch.long, device=dev) if torch_path else None)
                  for q0, n, c, t in prefills],
        num_prefill_tokens=sum(p[1] for p in prefills),
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long, device=dev),
        decode_context_lens=torch.zeros(0, dtype=torch.long, device=dev), decode_max_len=0,
        attention_backend=backend,
        context_groups=context_groups(prefills, BS, dev) if torch_path else [],
        prefill_tiles=None if torch_path else prefill_tiles(prefills, BS, group, dev))


REPS = 20 if torch.cuda.is_available() else 1  # the CPU smoke run only checks that it runs


def device_ms(fn: Callable[[], object], reps: int = REPS) -> float:
    """Device time of fn, replayed from a CUDA graph (no host cost); wall time per call on CPU."""
    if not torch.cuda.is_available():
        return eager_ms(fn, reps)[0]
    return time_cuda(fn, reps)


def eager_ms(fn: Callable[[], object], reps: int = REPS) -> tuple[float, float]:
    """(time per call back to back, host time per call to launch it) in ms."""
    cuda = torch.cuda.is_available()
    for _ in range(3 if cuda else 0):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / reps
    if not cuda:
        return host, host
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host


def launches(fn: Callable[[], object]) -> Optional[int]:
    """CUDA kernels (and copies) one call launches; None on CPU."""
    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA)


def guarded(fn: Callable[[], float]) -> object:
    """A timing, or the reason it could not be taken (printed in its cell, never hidden)."""
    try:
        return round(fn(), 4)
    except Exception as e:  # noqa: BLE001 - the table shows the failure
        return f"failed: {type(e).__name__}: {str(e)[:80]}"


def run_case(name: str, chunks: list, h: int, kvh: int, d: int, dtype: torch.dtype, dev: torch.device,
             sweep: bool) -> dict:
    q, k, v, kc, vc, prefills = build(chunks, h, kvh, d, dtype, dev)
    scale = d ** -0.5
    tp = q.shape[0]
    want = ref.prefill_attention(q.float(), kc.float(), vc.float(), prefills, scale)
    paths = {"today": meta_for(prefills, "torch", h // kvh, dev), "kernel": meta_for(prefills, "triton", h // kvh, dev)}
    row: dict = {"case": name, "chunks": len(chunks), "tokens": tp}
    for label, meta in paths.items():
        def call(meta=meta):
            return paged_attention(q, k, v, kc, vc, meta, scale)

        err = (call().float() - want).abs().max().item()
        row[f"{label}_err"] = round(err, 5)
        assert err < TOL, f"{name}: {label} path differs from the twin by {err}"
        row[f"{label}_device_ms"] = guarded(lambda: device_ms(call))
        e = eager_ms(call)
        row[f"{label}_eager_ms"], row[f"{label}_host_ms"] = round(e[0], 4), round(e[1], 4)
        row[f"{label}_launches"] = launches(call)
        print(f"  {name}: {label}: err {err:.2e}, device {row[f'{label}_device_ms']} ms, eager {e[0]:.3f} ms, "
              f"host {e[1]:.3f} ms, launches {row[f'{label}_launches']}", flush=True)
    if sweep:
        sw = {}
        for bm, bn, warps, stages in TILES:
            tiles = prefill_tiles(prefills, BS, h // kvh, dev, block_m=bm)
            out = torch.empty(tp, h, d, dtype=dtype, device=dev)

            def kern(tiles=tiles, out=out, bn=bn, warps=warps, stages=stages):
                return prefill_attention(q, kc, vc, tiles, scale, out=out, block_n=bn, num_warps=warps,
                                         num_stages=stages)

            err = (kern().float() - want).abs().max().item()
            key = f"m{bm} n{bn} w{warps} s{stages}"
            sw[key] = guarded(lambda: device_ms(kern)) if err < TOL else f"wrong: err {err:.3g}"
        row["tile_sweep_device_ms"] = sw
        print(f"  {name}: tile sweep {sw}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    head = ("| case | today device ms | kernel device ms | speed-up | today eager ms | kernel eager ms | "
            "today host ms | kernel host ms | launches today / kernel | best tiles (device ms) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        td, kd = r["today_device_ms"], r["kernel_device_ms"]
        speed = f"{td / kd:.2f}x" if isinstance(td, float) and isinstance(kd, float) and kd > 0 else "n/a"
        sweep = {k: v for k, v in r.get("tile_sweep_device_ms", {}).items() if isinstance(v, float)}
        best = min(sweep.items(), key=lambda kv: kv[1]) if sweep else None
        lines.append(f"| {r['case']} | {td} | {kd} | {speed} | {r['today_eager_ms']} | {r['kernel_eager_ms']} | "
                     f"{r['today_host_ms']} | {r['kernel_host_ms']} | {r['today_launches']} / {r['kernel_launches']} | "
                     f"{f'{best[0]} ({best[1]})' if best else 'n/a'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (4 / 2 heads, head_dim 64) for a CPU smoke run")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here too")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, kvh, d, cases = (4, 2, 64, SMALL) if args.small else (32, 8, 128, CASES)
    dtype = torch.bfloat16
    info = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    import triton

    print(f"prefill attention, {h} / {kvh} heads, head_dim {d}, {dtype}, block {BS}, on {info}, torch "
          f"{torch.__version__}, triton {triton.__version__}", flush=True)
    rows = [run_case(name, chunks, h, kvh, d, dtype, dev, not args.no_sweep) for name, chunks in cases.items()]
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print("\nOne layer, per call: device = CUDA-graph replay; eager = 20 calls back to back; host = launching one "
          "call; launches = CUDA kernels and copies of one call; best tiles = the sweep's fastest "
          "(rows x keys x warps x stages; default m128 n64 w8 s2).")
    print(table(rows))


if __name__ == "__main__":
    main()
