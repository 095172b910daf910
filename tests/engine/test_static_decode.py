"""The static-buffer decode step (engine/cuda_graph.py) against the eager step, on CPU.

On CUDA the same step is captured and replayed as a graph; here it runs eagerly over the same static
buffers, padding rows and fixed layout, so these tests cover everything but the capture itself.
Requests of different lengths make the batch shrink across the padded sizes (5 -> 1 sequences over
sizes 8, 4, 2, 1). Attention `triton` runs the decode kernel in Triton's interpreter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.cuda_graph import StaticDecode
from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from appliance.engine.runtime import graphs_off_reason
from tests.conftest import default_config

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "Water boils at", "1, 2, 3,"]


def run_lengths(engine: LLMEngine) -> dict[str, list[int]]:
    """Greedy, request i gets 3 + 2i new tokens, all submitted at once; id -> token ids."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), engine.tokenizer.encode(p),
                           SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True))
    res: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            res.setdefault(out.request_id, []).extend(out.token_ids)
    assert engine.block_manager.num_used == 0
    return res


def engine_for(model_dir: Path, attention: str) -> LLMEngine:
    return LLMEngine(default_config(f"model.path={model_dir}", "engine.num_kv_blocks=64",
                                    f"engine.attention_backend={attention}"))


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir: Path) -> dict[str, list[int]]:
    eng = engine_for(tiny_model_dir, "torch")
    assert eng.runner.static_decode is None  # cpu: no graphs, every step eager
    return run_lengths(eng)


def uncaptured_static_decode(eng: LLMEngine, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[StaticDecode, list[int]]:
    """The static-buffer decode step a CUDA graph replays, run uncaptured (cpu) for `eng` from now on,
    and the list that records the sequences of every step it runs."""
    eng.runner.start_static_decode(list(sizes), capture=False)
    sd = eng.runner.static_decode
    assert sd is not None
    used: list[int] = []
    real_run = sd.run
    sd.run = lambda plan, *a: (used.append(len(plan.decodes)), real_run(plan, *a))[1]  # type: ignore[method-assign]
    return sd, used


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_static_decode_gives_the_eager_tokens(tiny_model_dir: Path, eager_tokens: dict, attention: str) -> None:
    eng = engine_for(tiny_model_dir, attention)
    sd, used = uncaptured_static_decode(eng)
    assert run_lengths(eng) == eager_tokens
    assert used and max(used) == 5 and min(used) == 1  # the static path ran at sizes 8 down to 1
    assert sd.size_for(5) == 8 and sd.size_for(9) is None


def test_triton_attention_eager_gives_the_torch_tokens(tiny_model_dir: Path, eager_tokens: dict) -> None:
    eng = engine_for(tiny_model_dir, "triton")
    assert eng.runner.attention_backend == "triton"
    assert run_lengths(eng) == eager_tokens


def test_graph_settings_are_checked() -> None:
    from appliance.config.schema import ConfigError

    with pytest.raises(ConfigError, match="engine.attention_backend"):
        default_config("engine.attention_backend=flash")
    with pytest.raises(ConfigError, match="engine.cuda_graph_batch_sizes"):
        default_config("engine.max_num_seqs=8", "engine.cuda_graph_batch_sizes=[4,16]")
    e = default_config("engine.max_num_seqs=48").engine
    assert e.graph_batch_sizes() == [1, 2, 4, 8, 16, 32, 48]
    assert default_config("engine.cuda_graph_batch_sizes=[8,2,8]").engine.graph_batch_sizes() == [2, 8]


def test_split_k_and_graph_choice_on_a_given_sm_count(tiny_model_dir: Path) -> None:
    eng = engine_for(tiny_model_dir, "torch")
    r = eng.runner
    assert r.decode_splits(64, 8192) == 1  # cpu: never split
    assert "cpu" in r.runtime.decode_graphs_off
    r._sms = 132  # an H200's SM count; the tiny model has 2 KV heads
    assert r.decode_splits(0, 8192) == 1  # a step without decodes
    assert r.decode_splits(64, 8192) == 1  # 128 programs: no split
    assert r.decode_splits(16, 2048) == 4  # 32 programs <= 132 / 4: parts of 512 tokens
    assert r.decode_splits(1, 131072) == 64  # capped
    assert graphs_off_reason(default_config("engine.enforce_eager=true"), r.device, r.attention_backend,
                             None) == "engine.enforce_eager is true"
