"""A seeded request samples the same text whatever else is in its batch (other seeds, no seed, greedy,
penalties, logprobs), on the engine end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from tests.conftest import default_config

PROMPT = "Once upon a time"
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True, min_p=0.01,
                        presence_penalty=0.5)
OTHERS = [SamplingParams(max_tokens=7, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2)] + [
    SamplingParams(max_tokens=12, temperature=1.2, ignore_eos=True, frequency_penalty=1.0),
    SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=4, logit_bias={100: 50.0})]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(default_config(f"model.path={tiny_model_dir}", "model.device=cpu", "model.max_model_len=256"))


def run(engine: LLMEngine, batch: list[tuple[str, SamplingParams]]) -> dict[str, list[int]]:
    for i, (prompt, p) in enumerate(batch):
        engine.add_request(str(i), engine.tokenizer.encode(prompt), p)
    res: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            res.setdefault(o.request_id, []).extend(o.token_ids)
    return res


def test_seeded_text_does_not_depend_on_the_batch(engine: LLMEngine) -> None:
    alone = run(engine, [(PROMPT, SEEDED)])["0"]
    assert len(alone) == 10
    mixed = [("The capital of France is", p) for p in OTHERS]
    for at in (0, 2, 4):  # different positions among different neighbours
        batch = mixed[:at] + [(PROMPT, SEEDED)] + mixed[at:at + 2]
        assert run(engine, batch)[str(at)] == alone
    other_seed = SamplingParams(**{**SEEDED.__dict__, "seed": 99})
    assert run(engine, [(PROMPT, other_seed)])["0"] != alone


def test_logit_bias_forces_a_token_for_greedy_rows(engine: LLMEngine) -> None:
    out = run(engine, [("The capital of France is", OTHERS[3]), (PROMPT, SEEDED)])
    assert out["0"] == [100] * 5
