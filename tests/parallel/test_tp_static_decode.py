"""The static-buffer decode step under tensor parallelism, on CPU ranks (gloo): the tokens of eager steps.

On CUDA every rank captures the same decode graphs and replays them with the rows rank 0 staged and
sent (engine/cuda_graph.py); gloo cannot capture, so here the same static-buffer step runs uncaptured
on both ranks: SetupDecode, the DECODE control message with its int tensors, each rank's buffers and
padding, the fixed per-row LoRA layout over each rank's shard (or, with csgmv, the rows sorted by slot
on each rank), and the logits all-gather. Requests of
different lengths shrink the batch across the padded sizes; base and adapter rows are mixed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.engine import LLMEngine
from tests.lora.test_lora_engine import ADAPTERS, make_adapter
from tests.parallel.test_tp_engine import generate, tp_engine

JOBS = [(None, 0), ("qv4", 1), ("down2", 2), (None, 3), ("down2", 0)]  # (adapter, prompt)


def run_lengths(engine: LLMEngine) -> list[list[int]]:
    """Greedy, all submitted at once: decode batches of 5, 4, 2 and 1 rows (padded sizes 8, 4, 2, 1)."""
    out = generate(engine, JOBS, [2, 3, 3, 4, 5])
    assert engine.block_manager.num_used == 0
    return out


@pytest.mark.parametrize("backend", ["triton", "csgmv"])
def test_tp2_static_decode_gives_the_eager_tokens(tmp_path: Path, tiny_model_dir: Path, backend: str) -> None:
    adapters = {n: make_adapter(tiny_model_dir, tmp_path / n, seed=i, **ADAPTERS[n])
                for i, n in enumerate(("qv4", "down2"))}  # column- and row-parallel targets
    # lora.backend triton: the static step's fixed per-row layout is the kernels' (Triton's interpreter
    # on CPU, slow: only the projections the two adapters use are wrapped). csgmv on 2 slots: size 8
    # has 4 rows a slot, so every rank sorts its rows by slot inside the step (SORTED_MIN_ROWS_PER_SLOT).
    slots = 3 if backend == "triton" else 2
    lora = ("lora.enabled=true", "lora.max_lora_rank=8", f"lora.max_loras_per_batch={slots}",
            f"lora.backend={backend}", "lora.target_modules=[q_proj,v_proj,down_proj]",
            f"lora.adapter_roots=[{tmp_path}]")
    # The reference: tp 1, eager (tp 2 eager = tp 1: test_tp_engine.py), on the torch LoRA backend
    # (= the Triton kernels' tokens: tests/lora/test_lora_engine.py), which skips the interpreter.
    one = tp_engine(tiny_model_dir, 1, *lora[:3], "lora.backend=torch", *lora[4:])
    try:
        for name, path in adapters.items():
            one.lora.load(name, str(path))
        want = run_lengths(one)
    finally:
        one.close()
    engine = tp_engine(tiny_model_dir, 2, *lora)
    try:
        for name, path in adapters.items():
            engine.lora.load(name, str(path))
        assert engine.runner.static_decode is None  # cpu: eager unless asked
        engine.runner.start_static_decode([1, 2, 4, 8], capture=False)  # rank 1 builds its own
        sd = engine.runner.static_decode
        assert sd is not None and sd.sorted_layout(8) == (backend == "csgmv") and not sd.sorted_layout(4)
        used: list[int] = []
        real_run = sd.run
        sd.run = lambda plan, *a: (used.append(len(plan.decodes)), real_run(plan, *a))[1]  # type: ignore[method-assign]
        engine.stats.take()
        assert run_lengths(engine) == want  # tp 2, static buffers on both ranks
        assert sorted(set(used)) == [1, 2, 4, 5], used  # padded sizes 8, 4, 2, 1
        # Rank 0 records each step once (the workers never execute a plan).
        assert [t for p, t in engine.stats.take().steps if p == "graph"] == used
    finally:
        engine.close()
