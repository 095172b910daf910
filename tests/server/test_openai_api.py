"""The OpenAI routes against a live server with the default model, through the official `openai` client.

One server for the module (SmolLM2-135M-Instruct, API key on). Oracles: transformers' greedy generate
for the chat text; the OpenAI error shape for every bad input; the engine's in-flight count for aborts.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.server.conftest import API_KEY, ServerThread

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "List 3 countries and their capitals."}]


@pytest.fixture(scope="module")
def client(default_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def assert_error_shape(body: dict, code: str | None = None) -> None:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err


def assert_still_serving(srv: ServerThread, client: openai.OpenAI) -> None:
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert srv.wait_idle()


# ---------------------------------------------------------------------------------------------- basics

def test_models_list(client: openai.OpenAI, default_model_dir: Path) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "appliance"
    assert card["root"] == str(default_model_dir) and card["parent"] is None
    assert card["max_model_len"] == 2048 and isinstance(card["created"], int)


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                    temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert isinstance(out.created, int)
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].text.strip() and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == 5 and 1 <= out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_chat_greedy_matches_transformers(client: openai.OpenAI, default_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant"

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert msg.content == tok.decode(ref, skip_special_tokens=True)
    assert out.usage.prompt_tokens == ids.shape[1]
    assert out.usage.completion_tokens == len([t for t in ref.tolist() if t != tok.eos_token_id])


def test_chat_content_parts(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "List 3 countries"}, {"type": "text", "text": "and their capitals."}]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                         max_completion_tokens=3, temperature=0)
    assert out.usage.completion_tokens <= 3 and out.choices[0].message.content


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    # A sampled (not greedy) result: some other seed gives another text.
    assert any(sample(s) != first for s in (1, 2, 3))


# ---------------------------------------------------------------------------------------------- streaming

def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0)
    assert text == full.choices[0].message.content


def test_completion_stream_raw_sse(default_server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(default_server.url + "/v1/completions", json=body, headers=auth(), stream=True,
                       timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.content.decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]).strip()


# ---------------------------------------------------------------------------------------------- errors

def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert_error_shape(e.value.response.json(), "model_not_found")


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=-1),
    dict(max_tokens=0),
    dict(max_tokens=100_000),
    dict(temperature="hot"),
    dict(top_p=0),
    dict(n=0),
    dict(messages=[]),
    dict(messages=[{"role": "wizard", "content": "hi"}]),
    dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    dict(messages=[{"role": "user", "content": 5}]),
    dict(messages=[{"role": "user", "content": "word " * 3000}]),
    dict(stream_options={"include_usage": True}),
    dict(stop=["ok", ""]),
    dict(seed=-5),
    dict(logprobs=True, top_logprobs=21),
    dict(top_logprobs=2),
], ids=lambda kw: ",".join(f"{k}={str(v)[:20]}" for k, v in kw.items()))
def test_chat_bad_input(client: openai.OpenAI, default_server: ServerThread, kwargs: dict) -> None:
    args = dict(model=MODEL, messages=QUESTION, max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    body = e.value.response.json()
    assert_error_shape(body)
    assert body["error"]["type"] == "invalid_request_error"
    assert requests.get(default_server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("kwargs", [
    dict(prompt=""),
    dict(prompt=[]),
    dict(prompt=[[1, 2], "mixed"]),
    dict(prompt=[10**9]),
    dict(prompt=list(range(1, 2049))),
    dict(prompt=True),
    dict(max_tokens=2040, prompt=list(range(1, 10))),
    dict(echo=True, logprobs=1),
    dict(stop_token_ids=["x"]),
    dict(ignore_eos="yes"),
    dict(top_k=-2),
], ids=lambda kw: ",".join(f"{k}={str(v)[:20]}" for k, v in kw.items()))
def test_completion_bad_input(client: openai.OpenAI, default_server: ServerThread, kwargs: dict) -> None:
    args = dict(model=MODEL, prompt="Hi", max_tokens=4)
    extra = {k: kwargs.pop(k) for k in ("stop_token_ids", "ignore_eos", "top_k") if k in kwargs}
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args, extra_body=extra)
    assert_error_shape(e.value.response.json())
    assert requests.get(default_server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("raw", [b"{", b"", b"[1, 2]", b'"text"', b"{\"model\": NaN}", b"\xff\xfe\x00",
                                 b"[" * 100_000 + b"]" * 100_000, b'{"model": "SmolLM2-135M-Instruct"}'])
def test_malformed_body(default_server: ServerThread, raw: bytes) -> None:
    for route in ("/v1/completions", "/v1/chat/completions", "/generate"):
        r = requests.post(default_server.url + route, data=raw, timeout=30,
                          headers={**auth(), "Content-Type": "application/json"})
        assert r.status_code == 400, (route, r.text)
        assert_error_shape(r.json())


def test_route_and_method_errors(default_server: ServerThread) -> None:
    r = requests.get(default_server.url + "/v1/nothing", headers=auth(), timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = requests.get(default_server.url + "/v1/chat/completions", headers=auth(), timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert_error_shape(r.json(), "method_not_allowed")


def test_api_key(default_server: ServerThread) -> None:
    bad = openai.OpenAI(base_url=default_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert_error_shape(e.value.response.json(), "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    for headers in ({}, {"Authorization": "Basic " + API_KEY}, {"Authorization": "Bearer"}):
        r = requests.post(default_server.url + "/generate", json={"text": "hi"}, headers=headers, timeout=10)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert_error_shape(r.json(), "invalid_api_key")
    # /health is open (load balancers probe it without a key).
    assert requests.get(default_server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_still_serving_after_errors(client: openai.OpenAI, default_server: ServerThread) -> None:
    assert_still_serving(default_server, client)


# ---------------------------------------------------------------------------------------------- disconnects

def _send(srv: ServerThread, body: dict) -> http.client.HTTPConnection:
    """A raw connection (unlike requests, closing it surely closes the socket)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={**auth(), "Content-Type": "application/json"})
    return conn


def test_disconnect_mid_stream_aborts(client: openai.OpenAI, default_server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    conn = _send(default_server, body)
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # generation is under way
    assert default_server.engine.num_in_flight == 1
    resp.close()
    conn.close()
    assert default_server.wait_idle(timeout_s=10), "the stream's request was not aborted"
    assert_still_serving(default_server, client)


def test_disconnect_while_waiting_aborts(client: openai.OpenAI, default_server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True}
    conn = _send(default_server, body)
    deadline = time.monotonic() + 20
    while default_server.engine.num_in_flight == 0:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.02)
    conn.close()
    assert default_server.wait_idle(timeout_s=10), "the non-streaming request was not aborted"
    assert_still_serving(default_server, client)
