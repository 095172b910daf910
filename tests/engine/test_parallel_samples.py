"""Parallel samples of one prompt (`n`) share its KV: the prompt is computed once, and each sample gets
the tokens it would get alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from tests.conftest import default_config

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 shared, 8 tokens each sample computes


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(default_config(f"model.path={tiny_model_dir}", "model.device=cpu", "model.max_model_len=256",
                                    "engine.kv_block_size=16"))


def samples(engine: LLMEngine, share: bool) -> tuple[dict[str, list[int]], int]:
    """Four samples (greedy, and three seeds) of PROMPT; (tokens per id, prompt tokens computed)."""
    engine.stats.take()
    kinds = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] + [
        SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    for i, p in enumerate(kinds):
        engine.add_request(f"s{i}", PROMPT, p, prompt_source="s0" if share and i else None)
    res: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            res.setdefault(o.request_id, []).extend(o.token_ids)
    assert engine.block_manager.num_used == 0
    return res, engine.stats.take().prompt_tokens_computed


def test_n_samples_compute_the_prompt_once_and_keep_their_tokens(engine: LLMEngine) -> None:
    alone, computed_alone = samples(engine, share=False)
    shared, computed = samples(engine, share=True)
    assert computed_alone == 4 * len(PROMPT)
    assert computed == len(PROMPT) + 3 * (len(PROMPT) - 32)
    assert shared == alone
    assert len({tuple(v) for v in shared.values()}) > 1
