"""GPU check of overlap loading (lora.overlap_loading) on one CUDA device, before its benchmark.

A small shape-only Llama (random weights, float32, so greedy tokens do not depend on how requests are
batched), synthetic PEFT adapters, a CPU tier of 2 for 6 adapters, 2 GPU slots: every adapter but the
last two loaded starts cold. The same requests run on an engine without overlap loading and on one with
it (background reads slowed by debug.fault_injection_read_delay_s, staged side-stream copies);
the greedy tokens must be identical, the copies must have gone through the side stream, and tokens must
have been generated while reads were in flight. Exit status 1 on any mismatch. It also prints the
page-locked host blocks torch made while each run served (torch.cuda.host_memory_stats): overlap
loading stages its copies through buffers made at start-up, so "on" should make no more than "off".

    python benchmarks/overlap_gpu_check.py [--delay 0.2] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from appliance.bench.adapters import write_adapter
from appliance.config.compose import compose_config
from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from appliance.models.llama import ModelArgs

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5,
             rope_theta=10000.0, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=2,
             hidden_act="silu")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


DEVICE = "cuda"


def engine(shape: Path, root: Path, overlap: bool, delay: float) -> LLMEngine:
    return LLMEngine(compose_config(REPO / "configs", [
        "adapters=[]", f"model.path={shape}", "model.init=random", "model.source=null", "model.name=tiny",
        "model.dtype=float32", f"model.device={DEVICE}", "model.max_model_len=512", "engine.num_kv_blocks=256",
        "lora.enabled=true", "lora.max_lora_rank=16", "lora.max_loras_per_batch=2", "lora.max_loaded_loras=2",
        f"lora.adapter_roots=[{root}]", f"lora.overlap_loading={str(overlap).lower()}",
        f"debug.fault_injection_read_delay_s={delay}"]))


def run(eng: LLMEngine, dirs: dict[str, Path], jobs: list[tuple[str | None, list[int]]]) -> tuple[dict, dict]:
    for name, d in dirs.items():
        eng.lora.load(name, str(d))  # type: ignore[union-attr]
    pinned0 = _pinned()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, (name, ids) in enumerate(jobs):
        eng.add_request(str(i), ids, params, adapter=name)
    out: dict[str, list[int]] = {}
    during = 0  # tokens produced in steps that ended with a background read still in flight
    t0 = time.perf_counter()
    while eng.has_unfinished():
        got = eng.step()
        n = sum(len(o.token_ids) for o in got)
        for o in got:
            out.setdefault(o.request_id, []).extend(o.token_ids)
        if eng.lora.loads_in_flight()[0]:  # type: ignore[union-attr]
            during += n
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    ev = eng.stats.take()
    return out, {"wall_s": round(time.perf_counter() - t0, 3), "tokens_during_reads": during,
                 "cpu_loads": sum(ld.tier == "cpu" and ld.ok for ld in ev.loads),
                 "gpu_loads": sum(ld.tier == "gpu" and ld.ok for ld in ev.loads),
                 "load_errors": sum(not ld.ok for ld in ev.loads),
                 "side_stream": eng.lora.copier is not None,  # type: ignore[union-attr]
                 "pinned": tuple(b - a for a, b in zip(pinned0, _pinned()))}


def _pinned() -> tuple[int, int]:
    """(page-locked blocks, bytes) torch's host allocator has made so far in this process."""
    if DEVICE != "cuda":
        return (0, 0)
    st = torch.cuda.host_memory_stats()
    return (int(st.get("num_host_alloc", 0)), int(st.get("allocated_bytes.all.allocated",
                                                          st.get("allocated_bytes.allocated", 0))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=float, default=0.2, help="seconds each cold read sleeps first")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks this script (no side stream)")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    tmp = Path(tempfile.mkdtemp(prefix="overlap-check-"))
    shape = tmp / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(SHAPE))
    args = ModelArgs.from_hf_config(SHAPE)
    dirs = {f"a{i}": write_adapter(tmp / "adapters" / f"a{i}", args, 4 + 2 * i, TARGETS, seed=i, std=0.1,
                                   dtype=torch.float32, device=torch.device(DEVICE))
            for i in range(6)}
    g = torch.Generator().manual_seed(0)
    jobs: list[tuple[str | None, list[int]]] = [
        (name, torch.randint(10, 4096, (16 + 3 * j,), generator=g).tolist())
        for j, name in enumerate([None, "a0", "a5", "a1", None, "a2", "a3", "a0", "a4", "a5"])]
    ref, st_off = run(engine(shape, tmp / "adapters", False, 0.0), dirs, jobs)
    got, st_on = run(engine(shape, tmp / "adapters", True, a.delay), dirs, jobs)
    same = sum(ref[k] == got.get(k) for k in ref)
    print("| overlap | wall_s | tokens during reads | cold reads | slot loads | load errors | side stream | "
          "pinned blocks made while serving (bytes) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, s in (("off", st_off), ("on", st_on)):
        print(f"| {label} | {s['wall_s']} | {s['tokens_during_reads']} | {s['cpu_loads']} | {s['gpu_loads']} | "
              f"{s['load_errors']} | {s['side_stream']} | {s['pinned'][0]} ({s['pinned'][1]}) |")
    print(f"greedy tokens identical with and without overlap: {same}/{len(ref)} requests")
    ok = (same == len(ref) and st_on["side_stream"] == (DEVICE == "cuda") and st_on["tokens_during_reads"] > 0
          and st_on["load_errors"] == 0 and st_on["cpu_loads"] > 0 and st_on["gpu_loads"] > 0)
    print("OVERLAP CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
