"""The piecewise step (engine/piecewise.py) against the eager step, on CPU.

On CUDA its pieces are captured and replayed as graphs; here they run eagerly over the same static
buffers, padding rows and device-built LoRA layout, so these tests cover everything but the capture.
Every step that takes the piecewise path is also run eagerly first (same plan, same K/V slots): the
logits must agree; and the greedy tokens of the whole run must equal a run with every step eager.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

from appliance.engine.engine import LLMEngine
from appliance.engine.piecewise import PiecewiseStep
from appliance.engine.request import SamplingParams
from appliance.engine.step import StepBatch
from tests.conftest import default_config

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "Water boils at", "1, 2, 3,"]
SIZES = [4, 8, 16]


def make_engine(model_dir: Path, *overrides: str) -> LLMEngine:
    # A small token budget: long prompts are chunked, prefills share steps with decodes.
    return LLMEngine(default_config(f"model.path={model_dir}", "engine.num_kv_blocks=64",
                                    "engine.max_num_batched_tokens=12", "engine.kv_block_size=4", *overrides))


def checked_piecewise(eng: LLMEngine, sizes: list[int] = SIZES, atol: float = 1e-4,
                      aside_steps: Optional[list[bool]] = None) -> list[StepBatch]:
    """Run `eng`'s steps piecewise from now on (uncaptured), each also run eagerly first and compared;
    returns the list that records each piecewise step's batch. aside_steps (LoRA on): every other
    step's pieces (the 2nd, 4th, ...) take lora.decode_side_stream's order, the others and every eager
    step lora_apply's; the list records each piecewise step's order."""
    r = eng.runner
    r.start_piecewise(sizes, capture=False)
    pw = r.piecewise
    assert isinstance(pw, PiecewiseStep)
    used: list[StepBatch] = []
    real_run = pw.run

    def run(batch, token_slots: Optional[list[int]]) -> torch.Tensor:
        used.append(batch)
        lora = r.lora
        if lora is not None:  # the eager step's own layout, as execute builds it
            seg_lens = [q for _, q, _, _ in batch.prefills] + [1] * len(batch.decode_context_lens)
            seg_slots, row = [], 0
            for n in seg_lens:
                seg_slots.append(token_slots[row] if token_slots is not None else -1)
                row += n
            lora.use_layout(seg_lens, seg_slots)
        eager = r.forward(batch)
        if aside_steps is not None:
            aside_steps.append(len(used) % 2 == 0)
            lora.ctx.decode_aside = aside_steps[-1]
        got = real_run(batch, token_slots)
        if aside_steps is not None:
            lora.ctx.decode_aside = False
        assert got.shape == eager.shape
        diff = (got.float() - eager.float()).abs().max().item()
        assert diff <= atol, f"step of {len(batch.input_ids)} tokens: logits differ by {diff}"
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
        return got

    def isolate(plan, e: Exception) -> list:
        raise e  # the engine would rerun a failed step request by request and go on: fail the test instead

    pw.run = run  # type: ignore[method-assign]
    eng._isolate = isolate  # type: ignore[method-assign]
    return used


def run_all(engine: LLMEngine, jobs: list[tuple[Optional[str], int]], new: list[int], stagger: bool = False) -> dict:
    """Greedy, job j gets new[j] tokens; stagger: two requests added per step (prefills beside each
    other and beside decodes). -> job index -> token ids."""
    pending = list(enumerate(jobs))
    res: dict[int, list[int]] = {}

    def add() -> None:
        j, (name, p) = pending.pop(0)
        engine.add_request(str(j), engine.tokenizer.encode(PROMPTS[p]),
                           SamplingParams(max_tokens=new[j], temperature=0.0, ignore_eos=True), adapter=name)

    while pending and not stagger:
        add()
    while pending or engine.has_unfinished():
        for _ in range(min(2, len(pending))):
            add()
        for out in engine.step():
            res.setdefault(int(out.request_id), []).extend(out.token_ids)
    assert engine.block_manager.num_used == 0
    return res


BASE_JOBS = [(None, p) for p in range(5)] + [(None, 2), (None, 0)]  # repeats: prefix-cache hits
BASE_NEW = [3] * len(BASE_JOBS)  # the same count each: the run ends two decode steps after the last prefill


@pytest.fixture(scope="module")
def base_eager(tiny_model_dir: Path) -> dict:
    eng = make_engine(tiny_model_dir)
    assert eng.runner.piecewise is None  # cpu: the shipped null is off
    return run_all(eng, BASE_JOBS, BASE_NEW, stagger=True)


@pytest.mark.parametrize("fused", ["torch", "triton"])
def test_piecewise_gives_the_eager_tokens(tiny_model_dir: Path, base_eager: dict, fused: str) -> None:
    """Chunked prefills beside decodes, several prefills in a step, prefix-cache hits (a chunk over a
    cached context), padded sizes; fused triton runs RoPE + K/V write and the norms in the interpreter."""
    eng = make_engine(tiny_model_dir, f"engine.fused_kernels={fused}", "engine.attention_backend=triton")
    used = checked_piecewise(eng)
    assert run_all(eng, BASE_JOBS, BASE_NEW, stagger=True) == base_eager
    assert any(len(b.input_ids) not in SIZES for b in used)  # padded steps
    assert any(len(b.prefills) > 1 for b in used) and any(b.prefills and b.decode_context_lens for b in used)
    assert any(ctx > 0 for b in used for _, _, ctx, _ in b.prefills)  # chunks over a cached context


def test_steps_over_the_largest_size_run_eagerly(tiny_model_dir: Path, base_eager: dict) -> None:
    eng = make_engine(tiny_model_dir)
    used = checked_piecewise(eng, sizes=[2, 4])
    assert run_all(eng, BASE_JOBS, BASE_NEW, stagger=True) == base_eager
    assert used and max(len(b.input_ids) for b in used) <= 4
    assert eng.runner.piecewise is not None and eng.runner.piecewise.size_for(5) is None


def test_piecewise_settings() -> None:
    from appliance.config.schema import ConfigError

    e = default_config().engine  # shipped on (null): the sizes on cuda, off on cpu
    assert e.piecewise_sizes("cpu") == [] and e.piecewise_sizes("cuda") == [16, 32, 64, 128, 256, 512]
    assert default_config("engine.max_num_batched_tokens=100",
                          "engine.piecewise_graph_tokens=null").engine.piecewise_sizes("cuda") == [16, 32, 64]
    assert default_config("engine.piecewise_graph_tokens=[64,8,64]").engine.piecewise_sizes("cpu") == [8, 64]
    assert default_config("engine.piecewise_graph_tokens=[]").engine.piecewise_sizes("cuda") == []
    with pytest.raises(ConfigError, match="engine.piecewise_graph_tokens"):
        default_config("engine.max_num_batched_tokens=256", "engine.piecewise_graph_tokens=[512]")


def test_piecewise_off_reasons(tiny_model_dir: Path) -> None:
    from appliance.engine.runtime import piecewise_off_reason

    r = make_engine(tiny_model_dir).runner
    assert "cpu" in piecewise_off_reason(r.runtime, 1, [16])
    assert "piecewise_graph_tokens" in piecewise_off_reason(r.runtime, 1, [])


LORA = {"qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "all8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
        "mlp6": dict(r=6, lora_alpha=24, target_modules=["gate_proj", "up_proj", "down_proj"])}
LORA_JOBS = [("all8", 0), (None, 1), ("qv4", 3), ("mlp6", 4), ("all8", 2)]
LORA_NEW = [1, 2, 3, 2, 1]  # no decode tail: job 4's last prefill chunk (over its cached context) ends the run


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from tests.lora.test_lora_engine import make_adapter

    root = tmp_path_factory.mktemp("piece-adapters")
    for i, (name, kw) in enumerate(LORA.items()):
        make_adapter(tiny_model_dir, root / name, seed=10 + i, **kw)
    return root


def lora_engine(model_dir: Path, root: Path, *overrides: str) -> LLMEngine:
    # Two slots for three adapters: loads into slots between steps (copied into the buffers the pieces read).
    return make_engine(model_dir, "lora.enabled=true", "lora.max_lora_rank=8", "lora.max_loras_per_batch=2",
                       f"lora.adapter_roots=[{root}]", "lora.backend=triton", "engine.attention_backend=triton",
                       "engine.fused_kernels=triton", *overrides)


def test_piecewise_lora_gives_the_eager_tokens(tiny_model_dir: Path, lora_root: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed adapter and base rows in the slot-sorted device layout (chunks of 4 rows, so several chunks
    a slot for the 5- and 11-token prefills), base and padding rows in slot -1 chunks. Every other
    step's pieces take lora.decode_side_stream's order (shrink, base GEMM, expand), the others
    lora_apply's, so one run covers both orders against the same eager steps. gate_up_proj's expand
    runs inside the activation. No piece takes lora_linear (its path reads host facts of the step)."""
    import kernels.silu_mul_lora
    from appliance.lora.backend.triton_ops import TritonBackend

    in_act: list[bool] = []
    real_act = kernels.silu_mul_lora.silu_mul_lora
    monkeypatch.setattr(kernels.silu_mul_lora, "silu_mul_lora",
                        lambda *a, **k: (in_act.append(a[3].static_sorted), real_act(*a, **k))[1])
    prefill_paths: list[bool] = []  # per lora_linear call: inside a piece?
    real_prefill = TritonBackend._prefill
    monkeypatch.setattr(TritonBackend, "_prefill", lambda self, p, x, info: (
        prefill_paths.append(info.segments.static_sorted), real_prefill(self, p, x, info))[1])
    eng = lora_engine(tiny_model_dir, lora_root, "lora.max_chunk_size=4", "lora.decode_side_stream=false")
    for name in LORA:
        eng.lora.load(name, str(lora_root / name))
    aside: list[bool] = []
    used = checked_piecewise(eng, atol=1e-3, aside_steps=aside)
    loads_after: list[int] = []  # piecewise steps run before each adapter load into a slot
    real_ensure = eng.lora.ensure_loaded
    monkeypatch.setattr(eng.lora, "ensure_loaded", lambda loads: (
        loads_after.extend([len(used)] * len(loads)), real_ensure(loads))[1])
    # Each step's argmax equals the eager step's (checked_piecewise), so the run's tokens are the eager run's.
    out = run_all(eng, LORA_JOBS, LORA_NEW, stagger=True)
    assert sorted(out) == list(range(len(LORA_JOBS)))
    assert any(in_act) and not any(prefill_paths)  # lora_linear only in the checking eager steps
    assert any(len(b.prefills) > 1 for b in used) and any(b.prefills and b.decode_context_lens for b in used)
    assert any(n > 0 for n in loads_after)  # a slot refilled after the pieces had read it
    for order in (False, True):  # each order ran steps with prefill rows and with decode rows
        assert any(a == order and b.prefills for a, b in zip(aside, used)), order
        assert any(a == order and b.decode_context_lens for a, b in zip(aside, used)), order


def test_piecewise_refuses_the_torch_lora_backend(tiny_model_dir: Path) -> None:
    """Its per-step host groups are not in the pieces' layout: the deltas would be skipped."""
    eng = make_engine(tiny_model_dir, "lora.enabled=true", "lora.max_lora_rank=8", "lora.backend=torch")
    with pytest.raises(ValueError, match="lora.backend triton or csgmv"):
        eng.runner.start_piecewise([8], capture=False)
