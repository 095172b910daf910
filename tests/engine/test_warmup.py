"""Start-up warm-up (engine/warmup.py): the plan's bounds and coverage, and on CPU (Triton's interpreter)
that running it changes no output."""

from __future__ import annotations

from pathlib import Path

import torch

from appliance.bench.adapters import write_adapter
from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from appliance.engine.runtime import warmup_on
from appliance.engine.warmup import PREFILL_LENGTHS, plan_warmup
from appliance.models.llama import ModelArgs
from appliance.models.weights import read_hf_config
from tests.conftest import default_config


def test_warmup_default_is_on_for_cuda_only() -> None:
    e = default_config().engine
    assert e.warmup is None and warmup_on(e, "cuda") and not warmup_on(e, "cpu")
    assert warmup_on(default_config("engine.warmup=true").engine, "cpu")
    assert not warmup_on(default_config("engine.warmup=false").engine, "cuda")


def test_plan_covers_the_tile_buckets_within_the_limits() -> None:
    steps = plan_warmup(max_tokens=8192, max_model_len=16384, max_seqs=256, num_slots=32,
                        decode_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256], eager_decode=False)
    assert len(steps) <= 3 * (len(PREFILL_LENGTHS) + 1) + 2 + 9
    for s in steps:
        assert s.num_tokens <= 8192 and len(s.prefill_lens) + len(s.decode_slots) <= 256
        assert all(-1 <= x < 32 for x in s.prefill_slots + s.decode_slots)
        assert len(s.prefill_lens) == len(s.prefill_slots)
    one = {s.prefill_lens[0] for s in steps if len(s.prefill_lens) == 1 and not s.decode_slots}
    # Either side of every bucket edge of the LoRA kernels (16, 32, 256, 512) and the whole budget.
    assert {16, 17, 32, 33, 256, 257, 512, 513, 8192} <= one
    assert any(-1 in s.prefill_slots for s in steps)  # adapter + base tokens (lora_linear's zeroed rows)
    assert any(len(set(s.prefill_slots)) > 2 for s in steps)  # many segments
    ctx = {s.decode_context for s in steps if s.decode_slots and s.prefill_lens}
    assert len(ctx) == 2  # the attention kernel split (long context) and not
    # Graphs on: decode-only steps are the capture's business; one-token layouts come as a 1-token prefill.
    assert not any(s.decode_slots and not s.prefill_lens for s in steps)


def test_plan_without_lora_or_graphs() -> None:
    steps = plan_warmup(max_tokens=64, max_model_len=128, max_seqs=4, num_slots=0, decode_sizes=[1, 2, 4],
                        eager_decode=True)
    assert all(x == -1 for s in steps for x in s.prefill_slots + s.decode_slots)
    assert {len(s.decode_slots) for s in steps if not s.prefill_lens} == {1, 2, 4}
    assert max(s.num_tokens for s in steps) <= 64


def _engine(model_dir: Path, root: Path, warmup: bool) -> LLMEngine:
    return LLMEngine(default_config(
        f"model.path={model_dir}", "model.max_model_len=64", "engine.num_kv_blocks=64",
        "engine.max_num_batched_tokens=20", "engine.max_num_seqs=2", "engine.attention_backend=triton",
        f"engine.warmup={str(warmup).lower()}",
        "lora.enabled=true", "lora.backend=triton", "lora.max_lora_rank=8", "lora.max_loras_per_batch=2",
        "lora.target_modules=[q_proj,v_proj]", f"lora.adapter_roots=[{root}]"))


def _run(engine: LLMEngine, root: Path) -> dict[str, list[int]]:
    for name in ("a", "b"):
        engine.lora.load(name, str(root / name))  # type: ignore[union-attr]
    jobs = [("a", "The capital of France is"), (None, "def fibonacci(n):"), ("b", "Once upon a time, in a"),
            ("a", "Water boils at")]
    for i, (adapter, prompt) in enumerate(jobs):
        engine.add_request(str(i), engine.tokenizer.encode(prompt),
                           SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True), adapter=adapter)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def test_warmup_changes_no_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Triton attention + Triton LoRA kernels in the interpreter: the same greedy tokens (2 sequences
    at a time, chunks of up to 20 tokens, 2 adapters and base) with and without the warm-up. Small
    limits keep the plan short: the interpreter runs each kernel program in Python."""
    args = ModelArgs.from_hf_config(read_hf_config(tiny_model_dir))
    for seed, name in enumerate(("a", "b")):
        write_adapter(tmp_path / name, args, 8, ["q_proj", "v_proj"], seed, 0.3,
                      torch.float32, torch.device("cpu"))
    cold = _engine(tiny_model_dir, tmp_path, warmup=False)
    assert cold.warmup is None
    want = _run(cold, tmp_path)
    warm = _engine(tiny_model_dir, tmp_path, warmup=True)
    assert warm.warmup is not None and warm.warmup.steps > 0
    assert warm.warmup.compiled is None  # the interpreter compiles nothing
    assert warm.block_manager.num_used == 0 and warm.lora.ctx.info is None  # type: ignore[union-attr]
    assert _run(warm, tmp_path) == want
    assert len(want) == 4 and all(len(t) == 3 + int(i) for i, t in want.items())
