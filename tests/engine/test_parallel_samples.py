"""Parallel samples of one prompt (`n`) share its KV: the prompt is computed once, and each sample gets
the tokens it would get alone, synchronously and with async scheduling over the static decode buffers
(where a sample with one prompt token left runs its first pass as a decode row)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from tests.conftest import default_config
from tests.engine.test_static_decode import uncaptured_static_decode

KINDS = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] + [
    SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True, logprobs=1) for s in (1, 2, 3)]


def make(model_dir: Path, async_on: bool, caching: bool = False) -> LLMEngine:
    # Prefix caching off unless asked: these tests count the prompt tokens the sharing itself saves.
    eng = LLMEngine(default_config(f"model.path={model_dir}", "model.device=cpu", "model.max_model_len=256",
                                   "engine.kv_block_size=16", f"engine.async_scheduling={str(async_on).lower()}",
                                   f"engine.enable_prefix_caching={str(caching).lower()}"))
    if async_on:
        uncaptured_static_decode(eng)
    return eng


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return make(tiny_model_dir, False)


def samples(engine: LLMEngine, prompt: list[int], share: bool) -> tuple[dict[str, list], int]:
    """Four samples (greedy, and three seeds) of `prompt`; (tokens and logprobs per id, prompt tokens
    computed)."""
    engine.stats.take()
    for i, p in enumerate(KINDS):
        engine.add_request(f"s{i}", prompt, p, prompt_source="s0" if share and i else None)
    res: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            r = res.setdefault(o.request_id, [[], []])
            r[0] += o.token_ids
            r[1] += [round(lp.logprob, 4) for lp in o.logprobs or []]
    assert engine.block_manager.num_used == 0
    return res, engine.stats.take().prompt_tokens_computed


@pytest.mark.parametrize("length", [40, 33])  # 8 tokens past the 2 shared blocks; 1 (a decode-shaped pass)
def test_n_samples_compute_the_prompt_once_and_keep_their_tokens(engine: LLMEngine, length: int) -> None:
    prompt = list(range(100, 100 + length))
    alone, computed_alone = samples(engine, prompt, share=False)
    shared, computed = samples(engine, prompt, share=True)
    assert computed_alone == 4 * length
    assert computed == length + 3 * (length - 32)
    assert shared == alone
    assert len({tuple(v[0]) for v in shared.values()}) > 1


def test_n_samples_under_async_scheduling(engine: LLMEngine, tiny_model_dir: Path) -> None:
    prompt = list(range(100, 133))
    want, _ = samples(engine, prompt, share=False)
    got, computed = samples(make(tiny_model_dir, True), prompt, share=True)
    assert got == want and computed == 33 + 3


def test_n_samples_with_the_prefix_cache(engine: LLMEngine, tiny_model_dir: Path) -> None:
    """With prefix caching on, the samples still share the first one's blocks (computed once), and a
    second request of the same prompt takes the prompt's full blocks from the cache."""
    prompt = list(range(150, 190))
    want, _ = samples(engine, prompt, share=False)
    cached = make(tiny_model_dir, False, caching=True)
    got, computed = samples(cached, prompt, share=True)
    assert got == want and computed == 40 + 3 * 8
    again, computed = samples(cached, prompt, share=True)
    assert again == want and computed == 8 + 3 * 8
