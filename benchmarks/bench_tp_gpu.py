"""Tensor parallelism on one multi-GPU host: greedy parity tp 1 vs N, then decode speed at tp 1 vs N.

    python benchmarks/bench_tp_gpu.py --out tp.json              # N = 2 (NCCL); --tp 4 with 4 GPUs
    python benchmarks/bench_tp_gpu.py --smoke --out /tmp/tp.json # CPU, gloo, tiny shapes: checks the script
    python benchmarks/bench_tp_gpu.py --decode-only --out tp.json  # graphed decode at tp 1 and N only

1. Parity (float32, so that greedy tokens compare exactly): a small random Llama and a random
   Llama-3.1-8B-shaped model (configs/model/llama3-8b-shape.yaml, model.init=random), each with two
   random PEFT adapters (rank 8, all projections): the same mixed batch of base and adapter requests at
   tp 1 and tp N, in two configurations: `eager` (the default groups: lora.backend=torch, no graphs) and
   `graphs` (the GPU groups below: Triton LoRA and attention, decode steps replayed as CUDA graphs on
   every rank). Reports how many sequences came out identical (float32 sums in a different order can
   flip a near-tie of a random model's logits: the first differing step is reported, not hidden), and
   whether each engine really ran graphs.
2. Decode (bfloat16, the 8B shape; the tiny model with --smoke): median step ms and tokens/s of pure
   decode steps at batch 1, 16 and 64 (64-token prompts), requests spread over 4 adapters of rank 16,
   in the GPU configuration (`engine=gpu lora=gpu lora.backend=triton`, as the single-GPU figures of
   docs/performance.md) at tp 1 and tp N with graphs, and at tp N with engine.enforce_eager=true. Under
   TP, rank 0's time in the per-step control broadcast is reported too (`bcast_ms`).

Prints a table and writes everything to --out as JSON (rewritten after every phase, so a run cut short
keeps what it measured). Needs torch + appliance (+ hydra-core, omegaconf, safetensors; no tokenizer,
no download). About 3 minutes on 2 H200.
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from appliance.bench.adapters import make_adapters  # noqa: E402
from appliance.bench.offline import copy_bandwidth, decode_step, greedy  # noqa: E402
from appliance.config.compose import compose_config  # noqa: E402
from appliance.engine.engine import LLMEngine  # noqa: E402
from appliance.models.llama import ModelArgs  # noqa: E402
from appliance.models.weights import read_hf_config  # noqa: E402

SHAPE_8B = REPO / "appliance" / "models" / "shapes" / "llama-3.1-8b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_model(dest: Path, smoke: bool) -> Path:
    """A config.json-only random Llama (model.init=random); init std 0.08 keeps its logits apart."""
    dest.mkdir(parents=True, exist_ok=True)
    c = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096 if smoke else 32000,
             hidden_size=128 if smoke else 1024, intermediate_size=256 if smoke else 2816,
             num_hidden_layers=2 if smoke else 8, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.08,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu")
    (dest / "config.json").write_text(json.dumps(c))
    return dest


# The GPU configuration: configs/engine/gpu.yaml, configs/lora/gpu.yaml with the Triton LoRA kernels
# (graphs need them); overlap loading off, as tensor parallelism refuses it (same at tp 1, to compare).
GPU_GROUPS = ["engine=gpu", "lora=gpu", "lora.backend=triton", "lora.overlap_loading=false"]
# --smoke: CPU has no graphs, and the Triton interpreter would make it slow: the same groups, torch kernels.
SMOKE_GROUPS = ["engine=gpu", "lora=gpu", "lora.backend=torch", "lora.overlap_loading=false",
                "engine.attention_backend=torch"]


def engine(model_dir: Path, tp: int, dtype: str, device: str, root: Path, blocks: int, rank: int,
           extra: Sequence[str] = (), slots: int = 4) -> LLMEngine:
    cfg = compose_config(REPO / "configs", [
        *extra, "adapters=[]", f"model.path={model_dir}", "model.name=bench", "model.init=random",
        "model.source=null", f"model.dtype={dtype}", f"model.device={device}", "model.max_model_len=1024",
        f"engine.num_kv_blocks={blocks}", "engine.max_num_seqs=64", "lora.enabled=true",
        f"lora.max_lora_rank={rank}", f"lora.max_loras_per_batch={slots}", f"lora.adapter_roots=[{root}]",
        f"parallel.tp_size={tp}", f"parallel.master_port={free_port()}"])
    return LLMEngine(cfg)


def graphed(e: LLMEngine) -> bool:
    sd = e.runner.static_decode
    return sd is not None and sd.capture


class BroadcastTimer:
    """Rank 0's time in each control broadcast of one engine: a decode step's header + staged rows
    (graphs), or a pickled StepBatch (eager). The median over a decode run is a decode step's."""

    def __init__(self, e: LLMEngine) -> None:
        self.seconds: list[float] = []
        if e.tp is not None:
            g = e.tp.group
            for name in ("broadcast", "broadcast_decode"):
                setattr(g, name, self._timed(getattr(g, name)))

    def _timed(self, fn: Callable) -> Callable:
        def wrapped(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds.append(time.perf_counter() - t0)
        return wrapped

    def median_ms(self) -> Optional[float]:
        return round(1e3 * statistics.median(self.seconds), 3) if self.seconds else None


def release(box: list[LLMEngine]) -> float:
    """Stop the engine's other ranks and give its memory back before the next engine is built (the
    engine lives only in `box`, so no frame keeps it alive). Returns the seconds close() took: the
    workers must leave at once (an NCCL teardown once hung for 30 s until they were killed)."""
    t0 = time.perf_counter()
    while box:
        box.pop().close()
    closed = time.perf_counter() - t0
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return closed


def generate(e: LLMEngine, prompts: list[list[int]], adapters: list[Optional[str]], new: int) -> list[list[int]]:
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        e.add_request(str(i), p, greedy(new), adapter=a)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id] += o.token_ids
    return [out[str(i)] for i in range(len(prompts))]


def parity(name: str, model_dir: Path, tp: int, device: str, root: Path, new: int, mode: str,
           extra: Sequence[str]) -> dict:
    args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    std = float(read_hf_config(model_dir).get("initializer_range", 0.02))
    names = list(make_adapters(root / name, args, 8, 2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"], std, torch.float32,
                               torch.device("cpu"), progress=False).items())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab_size, (12 + 3 * i,), generator=g).tolist() for i in range(6)]
    adapters = [None, names[0][0], names[1][0], None, names[0][0], names[1][0]]
    runs, close_s, graphs = {}, {}, {}
    for size in (1, tp):
        t0 = time.perf_counter()
        box = [engine(model_dir, size, "float32", device, root / name, 256, 8, extra)]
        try:
            graphs[size] = graphed(box[0])
            for n, path in names:
                box[0].lora.load(n, str(path))
            runs[size] = generate(box[0], prompts, adapters, new)
        finally:
            close_s[size] = round(release(box), 2)
        print(f"  parity {name} {mode}: tp={size} done in {time.perf_counter() - t0:.1f} s (close {close_s[size]} s,"
              f" graphs {graphs[size]})", flush=True)
    first_diff = [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(runs[1], runs[tp])]
    same = sum(d is None for d in first_diff)
    return {"model": name, "mode": mode, "tp": tp, "graphs": [graphs[1], graphs[tp]], "sequences": len(prompts),
            "identical": same, "new_tokens": new, "first_differing_step": first_diff, "close_s": close_s,
            "tokens_tp1": runs[1], f"tokens_tp{tp}": runs[tp]}


def decode(name: str, model_dir: Path, tp: int, device: str, dtype: str, root: Path, batches: list[int],
           steps: int, bw: float, mode: str, extra: Sequence[str]) -> list[dict]:
    args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    std = float(read_hf_config(model_dir).get("initializer_range", 0.02))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = make_adapters(root / f"{name}-r16", args, 16, 4, targets, std, torch.bfloat16, torch.device("cpu"),
                             progress=False)
    g = torch.Generator().manual_seed(1)
    rows = []
    blocks = max(batches) * ((64 + steps + max(batches) + 8) // 16 + 2)
    t0 = time.perf_counter()
    box = [engine(model_dir, tp, dtype, device, root / f"{name}-r16", blocks, 16, extra, slots=32)]
    built_s = time.perf_counter() - t0
    try:
        uses_graphs = graphed(box[0])
        timer = BroadcastTimer(box[0])
        for n, path in adapters.items():
            box[0].lora.load(n, str(path))
        names = list(adapters)
        for b in batches:
            prompts = [torch.randint(3, args.vocab_size, (64,), generator=g).tolist() for _ in range(b)]
            timer.seconds.clear()
            row = decode_step(box[0], prompts, [names[i % len(names)] for i in range(b)], steps, bw, 16, targets)
            row.update(model=name, tp=tp, mode=mode, graphs=uses_graphs, build_s=round(built_s, 1),
                       tok_s=round(b / (row["step_ms"] / 1e3), 1), bcast_ms=timer.median_ms())
            rows.append(row)
            print(f"  decode {name} {mode} tp={tp} batch={b}: {row['step_ms']} ms/step, {row['tok_s']} tok/s, "
                  f"broadcast {row['bcast_ms']} ms (median)", flush=True)
    finally:
        release(box)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size to compare with 1 (default 2)")
    ap.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny shapes: check the script runs")
    ap.add_argument("--decode-only", action="store_true",
                    help="no parity, decode with graphs at tp 1 and tp N only (a quick check of a TP step change)")
    o = ap.parse_args()
    device = "cpu" if o.smoke else "cuda"
    if not o.smoke and torch.cuda.device_count() < o.tp:
        print(f"need {o.tp} GPUs, torch sees {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res: dict = {"tp": o.tp, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "gpus": torch.cuda.device_count(), "torch": torch.__version__, "smoke": o.smoke,
                 "parity": [], "decode": []}

    def save() -> None:
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        Path(o.out).write_text(json.dumps(res, indent=1))

    fast = SMOKE_GROUPS if o.smoke else GPU_GROUPS
    # Parity: both configurations on GPU; --smoke only the default one (no graphs on CPU).
    parity_modes = [("eager", [])]
    if not o.smoke:
        parity_modes.append(("graphs", [*GPU_GROUPS, "engine.cuda_graph_batch_sizes=[1,2,4,8]"]))
    # Decode: (label, tp, groups); the label says what ran, checked against the engine (`graphs` in the JSON).
    decode_runs = [("graphs", 1, fast), ("graphs", o.tp, fast), ("eager", o.tp, [*fast, "engine.enforce_eager=true"])]
    if o.smoke:
        decode_runs = [("cpu", 1, fast), ("cpu", o.tp, fast)]
    if o.decode_only:
        parity_modes, decode_runs = [], decode_runs[:2]
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        root = Path(tmp)
        small = small_model(root / "small", o.smoke)
        models = [("small", small)] + ([] if o.smoke else [("llama-3.1-8b-shape", SHAPE_8B)])
        def check(name: str, d: Path) -> None:
            for mode, extra in parity_modes:
                res["parity"].append(parity(name, d, o.tp, device, root, 8 if o.smoke else 24, mode, extra))
                save()

        # The small model's parity first (a broken capture shows in seconds), the 8B shape's last.
        print("parity (float32):", flush=True)
        check(*models[0])
        bw = copy_bandwidth(torch.device(device), 1 << 28)
        dec_name, dec_dir = models[-1]
        batches = [1, 4] if o.smoke else [1, 16, 64]
        steps = 4 if o.smoke else 32
        print(f"decode ({'float32' if o.smoke else 'bfloat16'}, {dec_name}):", flush=True)
        for mode, size, groups in decode_runs:
            res["decode"] += decode(dec_name, dec_dir, size, device, "float32" if o.smoke else "bfloat16", root,
                                    batches, steps, bw, mode, groups)
            save()
        for name, d in models[1:]:
            print("parity (float32):", flush=True)
            check(name, d)
    save()
    print(f"\n| model | check | tp=1 | tp={o.tp} |")
    print("|---|---|---|---|")
    for p in res["parity"]:
        g = "graphs " + "/".join("on" if x else "off" for x in p["graphs"])
        print(f"| {p['model']} | {p['mode']} ({g}): greedy sequences identical (of {p['sequences']}, "
              f"{p['new_tokens']} tokens) | - | {p['identical']} |")
        print(f"| {p['model']} | {p['mode']}: engine close() seconds | {p['close_s'][1]} | {p['close_s'][o.tp]} |")
    print(f"\n| {dec_name} decode | batch | ms/step (tok/s) | x floor | graphs | rank 0 broadcast ms (median) |")
    print("|---|---|---|---|---|---|")
    for d in res["decode"]:
        print(f"| {d['mode']} tp={d['tp']} | {d['batch']} | {d['step_ms']} ({d['tok_s']}) | {d['x_floor']} | "
              f"{'on' if d['graphs'] else 'off'} | {d['bcast_ms'] if d['bcast_ms'] is not None else '-'} |")
    print(f"\nwrote {o.out} in {res['wall_s']} s")
    return 0 if all(p["identical"] == p["sequences"] for p in res["parity"]) else 1


if __name__ == "__main__":
    sys.exit(main())
