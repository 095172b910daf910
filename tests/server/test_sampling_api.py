"""Sampling fields over HTTP with the official `openai` client: logprobs (chat, completions, streamed and
not, against transformers' log_softmax), penalties, logit_bias, min_p, seed, n and best_of; /generate's
return_logprob in SGLang's shape; the prompt of n samples computed once (/metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import requests
import torch

from tests.server.conftest import ServerThread

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "List 3 countries and their capitals."}]


@pytest.fixture(scope="module")
def client(default_open_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_open_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(default_model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(default_model_dir),
            AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval())


def greedy_logprobs(hf, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the float32 log_softmax of each step's logits [steps, vocab]."""
    _, model = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits)[:, 0].float().log_softmax(-1)


def chat_ids(hf) -> list[int]:
    tok, _ = hf
    return tok(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids


def test_chat_logprobs_equal_transformers_streamed_and_not(client: openai.OpenAI, hf) -> None:
    want_ids, want = greedy_logprobs(hf, chat_ids(hf), 6)
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == out.choices[0].message.content
    for j, c in enumerate(content):
        assert abs(c.logprob - want[j, want_ids[j]].item()) <= 1e-4
        top = want[j].topk(3)
        assert [round(t.logprob, 4) for t in c.top_logprobs] == [round(v, 4) for v in top.values.tolist()]
        assert c.top_logprobs[0].token == c.token and c.bytes == list(c.token.encode())
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [c for chunk in stream for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    # The second request reuses the first's cached prompt blocks (prefix caching): the same tokens, and
    # logprobs equal up to the float32 rounding of attention over a cached context.
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in zip(streamed, content))
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not(client: openai.OpenAI, hf) -> None:
    tok, _ = hf
    prompt = "The capital of France is"
    want_ids, want = greedy_logprobs(hf, tok(prompt).input_ids, 5)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == 5
    for j, v in enumerate(lp.token_logprobs):
        assert abs(v - want[j, want_ids[j]].item()) <= 1e-4
        assert len(lp.top_logprobs[j]) <= 2 and lp.tokens[j] in lp.top_logprobs[j]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(5)]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                       stream=True, extra_body={"ignore_eos": True})
    tokens, values, offsets = [], [], []
    for chunk in stream:
        for ch in chunk.choices:
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                values += ch.logprobs.token_logprobs
                offsets += ch.logprobs.text_offset
    assert (tokens, values, offsets) == (lp.tokens, lp.token_logprobs, lp.text_offset)


def test_generate_return_logprob(default_open_server: ServerThread, client: openai.OpenAI) -> None:
    body = {"text": "The capital of France is", "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True}}
    r = requests.post(default_open_server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    ref = client.completions.create(model=MODEL, prompt=body["text"], max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert [v for v, _, _ in meta["output_token_logprobs"]] == ref.token_logprobs
    assert [t for _, _, t in meta["output_token_logprobs"]] == ref.tokens
    assert [t for _, t, _ in meta["output_token_logprobs"]] == r.json()["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    with requests.post(default_open_server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    assert events[-1]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
    plain = requests.post(default_open_server.url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                          timeout=120).json()
    assert "output_token_logprobs" not in plain["meta_info"]


def test_penalties_bias_min_p_and_seed_take_effect(client: openai.OpenAI, hf) -> None:
    tok, _ = hf
    prompt = "Once upon a time"

    def text(extra: dict | None = None, **kw) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                         extra_body={"ignore_eos": True, **(extra or {})}, **kw).choices[0].text

    base = text(temperature=0)
    assert text(temperature=0, frequency_penalty=2.0) != base
    assert text(temperature=0, presence_penalty=2.0) != base
    assert text({"repetition_penalty": 1.8}, temperature=0) != base
    forced = tok.encode(" Paris", add_special_tokens=False)[0]
    assert text(temperature=0, logit_bias={str(forced): 100}) == " Paris" * 12
    assert text({"min_p": 0.1}, temperature=1.0, seed=5) == text({"min_p": 0.1}, temperature=1.0, seed=5)
    assert text({"min_p": 1.0}, temperature=1.0, seed=5) == base  # only the top token is left


def prompt_tokens_computed(default_open_server: ServerThread) -> float:
    for line in requests.get(default_open_server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("appliance_prompt_tokens_computed_total "):
            return float(line.split()[1])
    raise AssertionError("no appliance_prompt_tokens_computed_total")


def test_n_samples_share_the_prompt(default_open_server: ServerThread, client: openai.OpenAI, hf) -> None:
    tok, _ = hf
    prompt = "Write a long story about a dragon who learns to cook. " * 6
    n_prompt = len(tok(prompt).input_ids)
    before = prompt_tokens_computed(default_open_server)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=3, n=4)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == n_prompt
    tail = n_prompt - (n_prompt - 1) // 16 * 16  # each extra sample computes its own last block
    assert prompt_tokens_computed(default_open_server) - before == n_prompt + 3 * tail
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=3, n=4)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert len({c.text for c in out.choices}) > 1
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, n=2, temperature=1.0)
    assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_returns_the_most_likely(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=1.0,
                                    seed=1, best_of=4, n=2, logprobs=0)
    assert len(out.choices) == 2 and out.usage.completion_tokens >= 4
    sums = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert sums == sorted(sums, reverse=True)
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=1.0, best_of=3)
    assert len(plain.choices) == 1 and plain.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21}, "logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
])
def test_bad_sampling_fields_are_400_naming_the_field(default_open_server: ServerThread, body: dict, param: str) -> None:
    r = requests.post(default_open_server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body},
                      timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_chat_top_logprobs_needs_logprobs(default_open_server: ServerThread) -> None:
    r = requests.post(default_open_server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 2, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
