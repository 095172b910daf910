"""Logprobs from the engine against transformers' log_softmax (float32) on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from appliance.engine.engine import LLMEngine
from appliance.engine.request import RequestOutput, SamplingParams
from tests.conftest import default_config

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(default_config(f"model.path={tiny_model_dir}", "model.device=cpu", "model.max_model_len=256"))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for rid, (ids, p) in requests.items():
        engine.add_request(rid, ids, p)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def test_logprobs_equal_transformers_log_softmax(engine: LLMEngine, tiny_model_dir: Path) -> None:
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    params = {  # a mixed batch: greedy with top 5, sampled (penalised, biased) with top 20, none, chosen only
        "a": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5),
        "b": SamplingParams(max_tokens=6, temperature=1.3, seed=7, ignore_eos=True, logprobs=20,
                            presence_penalty=1.0, logit_bias={11: 5.0}),
        "c": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        "d": SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True, logprobs=0),
    }
    prompts = {rid: engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i, rid in enumerate(params)}
    outs = run(engine, {rid: (prompts[rid], p) for rid, p in params.items()})
    for rid, p in params.items():
        ids = [t for o in outs[rid] for t in o.token_ids]
        assert len(ids) == 6
        if p.logprobs is None:
            assert all(o.logprobs is None for o in outs[rid])
            continue
        lps = [lp for o in outs[rid] for lp in o.logprobs]  # type: ignore[union-attr]
        assert [lp.token_id for lp in lps] == ids
        full = torch.tensor(prompts[rid] + ids)
        with torch.no_grad():
            want = ref(full[None]).logits[0].float().log_softmax(-1)[len(prompts[rid]) - 1:-1]
        for j, lp in enumerate(lps):
            assert abs(lp.logprob - want[j, ids[j]].item()) <= 1e-4
            assert len(lp.top) == p.logprobs
            if p.logprobs:
                top = want[j].topk(p.logprobs)
                got_vals = torch.tensor([v for _, v in lp.top])
                assert (got_vals - top.values).abs().max().item() <= 1e-4
                # Ids agree where the values are not near-ties.
                assert lp.top[0][0] == int(top.indices[0]) or abs(top.values[0] - top.values[1]) < 1e-4
        if p.greedy:
            assert all(lp.top[0][0] == lp.token_id for lp in lps)


def test_stop_token_drops_its_logprob(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode(PROMPTS[0])
    free = run(engine, {"x": (ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1))})["x"]
    toks = [t for o in free for t in o.token_ids]
    cut = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])  # its first appearance
    stopped = run(engine, {"y": (ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1,
                                                     stop_token_ids=[toks[cut]]))})["y"]
    got = [t for o in stopped for t in o.token_ids]
    lps = [lp for o in stopped for lp in o.logprobs]  # type: ignore[union-attr]
    assert got == toks[:cut] and [lp.token_id for lp in lps] == got
