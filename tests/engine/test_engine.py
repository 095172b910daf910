"""The engine end to end on real weights: batch invariance, preemption, chunked prefill, sampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.request import RequestError, RequestOutput, SamplingParams
from tests.conftest import default_config

PROMPTS = [
    "The capital of France is",
    "List 3 countries and their capitals.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "My favourite colour is blue because",
]


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> dict[str, tuple[list[int], str, str]]:
    """Submit all prompts at once, step to completion; request id -> (token ids, text, finish reason)."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), engine.tokenizer.encode(p), params)
    res: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = res.setdefault(out.request_id, [[], "", None])
            r[0] += out.token_ids
            r[1] += out.text
            if out.finished:
                r[2] = out.finish_reason
    assert engine.block_manager.num_used == 0, "KV blocks leaked"
    return {k: (v[0], v[1], v[2]) for k, v in res.items()}


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(default_model_dir: Path) -> LLMEngine:
    return LLMEngine(default_config(f"model.path={default_model_dir}", "engine.num_kv_blocks=256"))


@pytest.fixture(scope="module")
def together(engine: LLMEngine) -> dict[str, tuple[list[int], str, str]]:
    """All 8 prompts decoded in one batch with a roomy cache: the reference for the tests below."""
    return run(engine, PROMPTS, GREEDY)


def test_batch_invariance(engine: LLMEngine, together: dict) -> None:
    for i, p in enumerate(PROMPTS):
        alone = run(engine, [p], GREEDY)["0"]
        assert together[str(i)][0] == alone[0], f"prompt {i} differs in a batch"
        assert together[str(i)][1] == engine.tokenizer.decode(alone[0])


def test_preemption_with_small_cache_gives_same_tokens(default_model_dir: Path, together: dict) -> None:
    # 8 prompts of ~10 tokens + 16 new need 2 blocks of 16 each; 9 blocks force preemptions.
    small = LLMEngine(default_config(f"model.path={default_model_dir}", "engine.num_kv_blocks=9"))
    got = run(small, PROMPTS, GREEDY)
    assert small.scheduler.num_preemptions > 0
    assert got == together


def test_chunked_prefill_matches_whole_prefill(default_model_dir: Path, together: dict) -> None:
    chunked = LLMEngine(default_config(f"model.path={default_model_dir}", "engine.num_kv_blocks=256",
                                       "engine.max_num_batched_tokens=7"))
    assert run(chunked, PROMPTS, GREEDY) == together


def test_seed_gives_same_text_and_differs_across_seeds(engine: LLMEngine) -> None:
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    a = run(engine, PROMPTS[:1], p)["0"]
    b = run(engine, PROMPTS[:3], p)["0"]  # same seed in a different batch: same draw sequence
    assert a == b
    c = run(engine, PROMPTS[:1], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))["0"]
    assert c[0] != a[0]


def test_max_tokens_and_length_finish(engine: LLMEngine) -> None:
    ids, _, reason = run(engine, PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))["0"]
    assert len(ids) == 5 and reason == "length"


def test_stop_string_is_cut_and_not_returned(engine: LLMEngine, together: dict) -> None:
    ids, text, _ = together["4"]  # counting: " 5, 6, 7, ..."
    assert " 7" in text
    cut_ids, cut_text, reason = run(engine, PROMPTS[4:5], SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, stop=[" 7"]))["0"]
    assert reason == "stop"
    assert cut_text == text[: text.index(" 7")]


def test_stop_token_ids_end_without_the_token(engine: LLMEngine, together: dict) -> None:
    ids, _, _ = together["4"]
    stop_tok = ids[3]
    got, _, reason = run(engine, PROMPTS[4:5], SamplingParams(max_tokens=16, temperature=0.0,
                                                            stop_token_ids=[stop_tok]))["0"]
    assert reason == "stop" and got == ids[: ids.index(stop_tok)]


def test_eos_ends_chat_reply(engine: LLMEngine) -> None:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    engine.add_request("chat", ids, SamplingParams(max_tokens=200, temperature=0.0))
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert not set(sum((o.token_ids for o in outs), [])) & engine.tokenizer.eos_token_ids


def test_abort_frees_blocks(engine: LLMEngine) -> None:
    engine.add_request("x", engine.tokenizer.encode(PROMPTS[0]), GREEDY)
    engine.step()
    assert engine.block_manager.num_used > 0
    engine.abort("x")
    assert engine.block_manager.num_used == 0 and not engine.has_unfinished()


def test_too_long_request_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match="maximum context length"):
        engine.check_request([1] * 2000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="empty"):
        engine.check_request([], SamplingParams())
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0).validate()
