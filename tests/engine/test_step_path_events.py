"""Each model step is recorded once with the path it ran (graph, piecewise, eager) and its tokens, on CPU.

CPU runs every step eagerly unless a test forces the static decode or the piecewise buffers
(uncaptured); the label says which buffers ran, whether or not a graph was captured.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from tests.conftest import default_config

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [22, 23]]
NEW = [4, 6, 3, 5]
# Every prompt token runs once (no preemption with these blocks), and every token but the last of a request.
TOKENS = sum(len(p) for p in PROMPTS) + sum(n - 1 for n in NEW)


def engine_for(model_dir: Path, *overrides: str) -> LLMEngine:
    # A small token budget: the long prompt is chunked, prefills share steps with decodes.
    return LLMEngine(default_config(f"model.path={model_dir}", "engine.num_kv_blocks=64",
                                    "engine.max_num_batched_tokens=12", "engine.kv_block_size=4", *overrides))


def run_steps(eng: LLMEngine) -> list[tuple[str, int]]:
    """All requests at once, greedy, to the end; the steps the engine recorded."""
    for i, (p, n) in enumerate(zip(PROMPTS, NEW)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.settle()
    return eng.stats.take().steps


def test_cpu_steps_are_eager(tiny_model_dir: Path) -> None:
    eng = engine_for(tiny_model_dir)
    calls = []
    real = eng.runner.execute
    eng.runner.execute = lambda plan, *a: (calls.append(1), real(plan, *a))[1]  # type: ignore[method-assign]
    steps = run_steps(eng)
    assert {p for p, _ in steps} == {"eager"} and len(steps) == len(calls)
    assert sum(t for _, t in steps) == TOKENS and max(t for _, t in steps) <= 12


@pytest.mark.parametrize("async_on", [False, True])
def test_static_decode_steps_are_graph_steps_counted_once(tiny_model_dir: Path, async_on: bool) -> None:
    eng = engine_for(tiny_model_dir, f"engine.async_scheduling={str(async_on).lower()}")
    eng.runner.start_static_decode([1, 2, 4], capture=False)
    sd = eng.runner.static_decode
    assert sd is not None and eng.async_scheduling is async_on
    rows: list[int] = []
    real = sd.run
    sd.run = lambda plan, *a: (rows.append(len(plan.decodes)), real(plan, *a))[1]  # type: ignore[method-assign]
    steps = run_steps(eng)
    assert [t for p, t in steps if p == "graph"] == rows and rows  # one event per static run, its real rows
    assert {p for p, _ in steps} == {"graph", "eager"}  # prefills still run eagerly
    assert sum(t for _, t in steps) == TOKENS


def test_piecewise_steps_and_larger_ones(tiny_model_dir: Path) -> None:
    eng = engine_for(tiny_model_dir)
    eng.runner.start_piecewise([4, 8], capture=False)  # steps of 9..12 tokens run eagerly
    steps = run_steps(eng)
    assert {p for p, t in steps if t <= 8} == {"piecewise"}
    assert {p for p, t in steps if t > 8} == {"eager"}
    assert sum(t for _, t in steps) == TOKENS
