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


def checked_piecewise(eng: LLMEngine, sizes: list[int] = SIZES, atol: float = 1e-4) -> list[StepBatch]:
    """Run `eng`'s steps piecewise from now on (uncaptured), each also run eagerly first and compared;
    returns the list that records each piecewise step's batch."""
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
        got = real_run(batch, token_slots)
        assert got.shape == eager.shape
        diff = (got.float() - eager.float()).abs().max().item()
        assert diff <= atol, f"step of {len(batch.input_ids)} tokens: logits differ by {diff}"
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
        return got

    pw.run = run  # type: ignore[method-assign]
    return used


def run_all(engine: LLMEngine, jobs: list[tuple[Optional[str], int]], new: int, stagger: bool = False) -> dict:
    """Greedy, job j gets `new` + j tokens; stagger: two requests added per step (prefills beside
    each other and beside decodes). -> job index -> token ids."""
    pending = list(enumerate(jobs))
    res: dict[int, list[int]] = {}

    def add() -> None:
        j, (name, p) = pending.pop(0)
        engine.add_request(str(j), engine.tokenizer.encode(PROMPTS[p]),
                           SamplingParams(max_tokens=new + j, temperature=0.0, ignore_eos=True), adapter=name)

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


@pytest.fixture(scope="module")
def base_eager(tiny_model_dir: Path) -> dict:
    eng = make_engine(tiny_model_dir)
    assert eng.runner.piecewise is None  # cpu: piecewise_graph_tokens null is off
    return run_all(eng, BASE_JOBS, 3, stagger=True)


@pytest.mark.parametrize("fused", ["torch", "triton"])
def test_piecewise_gives_the_eager_tokens(tiny_model_dir: Path, base_eager: dict, fused: str) -> None:
    """Chunked prefills beside decodes, several prefills in a step, prefix-cache hits (a chunk over a
    cached context), padded sizes; fused triton runs RoPE + K/V write and the norms in the interpreter."""
    eng = make_engine(tiny_model_dir, f"engine.fused_kernels={fused}", "engine.attention_backend=triton")
    used = checked_piecewise(eng)
    assert run_all(eng, BASE_JOBS, 3, stagger=True) == base_eager
    assert any(len(b.input_ids) not in SIZES for b in used)  # padded steps
    assert any(len(b.prefills) > 1 for b in used) and any(b.prefills and b.decode_context_lens for b in used)
    assert any(ctx > 0 for b in used for _, _, ctx, _ in b.prefills)  # chunks over a cached context


def test_steps_over_the_largest_size_run_eagerly(tiny_model_dir: Path, base_eager: dict) -> None:
    eng = make_engine(tiny_model_dir)
    used = checked_piecewise(eng, sizes=[2, 4])
    assert run_all(eng, BASE_JOBS, 3, stagger=True) == base_eager
    assert used and max(len(b.input_ids) for b in used) <= 4
    assert eng.runner.piecewise is not None and eng.runner.piecewise.size_for(5) is None


def test_piecewise_settings() -> None:
    from appliance.config.schema import ConfigError

    e = default_config().engine
    assert e.piecewise_sizes("cpu") == [] and e.piecewise_sizes("cuda") == [16, 32, 64, 128, 256, 512]
    assert default_config("engine.max_num_batched_tokens=100").engine.piecewise_sizes("cuda") == [16, 32, 64]
    assert default_config("engine.piecewise_graph_tokens=[64,8,64]").engine.piecewise_sizes("cpu") == [8, 64]
    assert default_config("engine.piecewise_graph_tokens=[]").engine.piecewise_sizes("cuda") == []
    with pytest.raises(ConfigError, match="engine.piecewise_graph_tokens"):
        default_config("engine.max_num_batched_tokens=256", "engine.piecewise_graph_tokens=[512]")


def test_piecewise_off_reasons(tiny_model_dir: Path) -> None:
    from appliance.engine.runtime import piecewise_off_reason

    r = make_engine(tiny_model_dir).runner
    assert "cpu" in piecewise_off_reason(r.runtime, 1, [16])
    assert "piecewise_graph_tokens" in piecewise_off_reason(r.runtime, 1, [])
