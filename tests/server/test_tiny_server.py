"""Load, batches and the native /generate against a live server with the tiny random model (fast, gibberish).

One server for the module: no API key, max_model_len 512, a 64 KiB body limit.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.server.conftest import ServerThread, start_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tiny_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(r: requests.Response) -> list[dict]:
    """Parse an SSE body; checks it ends with [DONE]."""
    events = r.content.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def test_64_concurrent_streams(tiny_server: ServerThread) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i}:", max_tokens=24, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            else:
                usage = chunk.usage
        return text, usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(n == 24 for _, n in results)
    assert len({t for t, _ in results}) > 1  # different prompts and seeds
    assert tiny_server.wait_idle()


def test_completion_batch_of_prompts(client: openai.OpenAI) -> None:
    prompts = ["one", "two two", "three three three"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 15
    for p, c in zip(prompts, out.choices):
        single = client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert c.text == single.choices[0].text and c.finish_reason == "length"


def test_completion_token_id_prompts(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert len(out.choices) == 2 and out.usage.prompt_tokens == 5
    single = client.completions.create(model=MODEL, prompt=[8, 9], max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert out.choices[1].text == single.choices[0].text


def test_completion_batch_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=4, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    finished = {}
    for chunk in stream:
        c = chunk.choices[0]
        if c.finish_reason is not None:
            finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length"}


def test_stop_and_stop_token_ids(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 4
    stop = base[2:4]
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == base[:base.index(stop)]


def test_generate_single(tiny_server: ServerThread) -> None:
    r = requests.post(tiny_server.url + "/generate", timeout=30, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert len(out["output_ids"]) == 6 and out["text"]
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["finish_reason"] == "length"
    assert meta["prompt_tokens"] >= 1 and meta["id"].startswith("gen-")


def test_generate_batch(tiny_server: ServerThread) -> None:
    r = requests.post(tiny_server.url + "/generate", timeout=30, json={
        "input_ids": [[5, 6, 7], [8, 9]],
        "sampling_params": [{"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
                            {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and [len(o["output_ids"]) for o in out] == [2, 4]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 2]
    single = requests.post(tiny_server.url + "/generate", timeout=30, json={
        "input_ids": [8, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                 "ignore_eos": True}}).json()
    assert single["output_ids"] == out[1]["output_ids"] and single["text"] == out[1]["text"]


def test_generate_stream_is_cumulative(tiny_server: ServerThread) -> None:
    body = {"text": ["Hi", "Bye"], "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with requests.post(tiny_server.url + "/generate", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
    final = requests.post(tiny_server.url + "/generate", timeout=30, json={**body, "stream": False}).json()
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        ids = [e["output_ids"] for e in mine]
        assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:]))  # each event extends the previous
        assert mine[-1]["meta_info"]["finish_reason"] == "length"
        assert mine[-1]["text"] == final[i]["text"] and mine[-1]["output_ids"] == final[i]["output_ids"]


def test_generate_long_stream_ends_with_finish_and_done(tiny_server: ServerThread) -> None:
    # Past schemathesis' default of 20 events (the fuzz's false alarm): one event per token, then [DONE].
    body = {"input_ids": [1, 2, 3], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
    with requests.post(tiny_server.url + "/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    final = requests.post(tiny_server.url + "/generate", timeout=60, json={**body, "stream": False}).json()
    assert events[-1]["meta_info"]["finish_reason"] == "length" and len(events[-1]["output_ids"]) == 40
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["output_ids"] == final["output_ids"] and events[-1]["text"] == final["text"]


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_server_fault_mid_stream_is_an_error_event(tiny_server: ServerThread, monkeypatch: pytest.MonkeyPatch,
                                                   route: str) -> None:
    # A bug in our own event building (injected: the engine runs for real) after the 200 went out.
    from appliance.server import protocol

    name, real = (("GenerateEvents.event", protocol.GenerateEvents.event) if route == "/generate"
                  else ("completion_chunk", protocol.completion_chunk))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(protocol.GenerateEvents if route == "/generate" else protocol, name.split(".")[-1], broken)
    body = ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
            if route == "/generate" else {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True})
    with requests.post(tiny_server.url + route, json={**body, "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert len(events) == 3 and set(events[-1]) == {"error"}
    assert events[-1]["error"] == {"message": "Internal server error: KeyError", "type": "server_error",
                                   "param": None, "code": None}
    if route == "/v1/completions":  # the official client raises it, after the chunks before it
        calls.clear()
        client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = []
        with pytest.raises(openai.APIError, match="Internal server error: KeyError"):
            for c in client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=8, stream=True,
                                               extra_body={"ignore_eos": True}):
                got.append(c.choices[0].text)
        assert len(got) == 2
    monkeypatch.undo()
    assert tiny_server.wait_idle()  # the request was aborted in the engine
    assert requests.post(tiny_server.url + route, json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_generate_skip_special_tokens(tiny_server: ServerThread, default_model_dir: Path, stream: bool) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    special = tok.convert_tokens_to_ids("<|im_start|>")
    texts = {}
    for skip in (None, True, False):  # None: the default (true)
        params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(special): 100}}
        if skip is not None:
            params["skip_special_tokens"] = skip
        body = {"text": "Hi", "stream": stream, "sampling_params": params}
        with requests.post(tiny_server.url + "/generate", json=body, stream=stream, timeout=60) as r:
            assert r.status_code == 200, r.text
            out = sse_events(r)[-1] if stream else r.json()
        assert out["output_ids"] == [special] * 3
        assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=skip is not False)
        texts[skip] = out["text"]
    assert texts[None] == texts[True] == "" and texts[False] == "<|im_start|>" * 3


@pytest.mark.parametrize("body", [
    {},
    {"text": "a", "input_ids": [1]},
    {"text": ""},
    {"text": []},
    {"input_ids": []},
    {"input_ids": [[1], []]},
    {"input_ids": [1, "2"]},
    {"text": "a", "sampling_params": {"max_new_tokens": 0}},
    {"text": "a", "sampling_params": {"max_new_tokens": 600}},
    {"text": "a", "sampling_params": {"temperature": "hot"}},
    {"text": "a", "sampling_params": {"frequency_penalty": 5.0}},
    {"text": "a", "top_logprobs_num": 21, "return_logprob": True},
    {"text": "a", "sampling_params": [{}]},
    {"text": ["a", "b"], "sampling_params": [{}]},
    {"text": "a", "sampling_params": 3},
    {"text": "a", "streem": True},
    {"text": "a", "stream": "yes"},
])
def test_generate_bad_input(tiny_server: ServerThread, body: dict) -> None:
    r = requests.post(tiny_server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_generate_unknown_model(tiny_server: ServerThread) -> None:
    r = requests.post(tiny_server.url + "/generate", json={"text": "a", "model": "other"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_body_too_large(tiny_server: ServerThread, client: openai.OpenAI) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * 100_000})
    r = requests.post(tiny_server.url + "/v1/completions", data=big, timeout=30,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 10_000
    r = requests.post(tiny_server.url + "/v1/completions", data=chunks(), timeout=30)
    assert r.status_code == 413
    assert requests.get(tiny_server.url + "/health", timeout=10).status_code == 200
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).usage.completion_tokens <= 1


def test_queue_full_is_429(tiny_model_dir: Path) -> None:
    srv = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=512",
                       "model.device=cpu", "engine.max_num_seqs=1", "engine.max_waiting_requests=1")
    try:
        long = {"model": MODEL, "prompt": "a", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with requests.post(srv.url + "/v1/completions", json=long, stream=True, timeout=60) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep a reference: a dropped iterator closes the socket
            next(lines)  # it runs; the only sequence slot is taken
            waiting = threading.Thread(target=requests.post, args=(srv.url + "/v1/completions",),
                                       kwargs=dict(json={"model": MODEL, "prompt": "b", "max_tokens": 2},
                                                   timeout=60))
            waiting.start()
            deadline = time.monotonic() + 10
            while srv.engine.engine.num_waiting < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = requests.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "c"}, timeout=10)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        waiting.join(30)
        assert srv.wait_idle()
    finally:
        srv.stop()


WEIRD_VALUES = [None, True, False, 0, -1, 1, 1.5, 10**30, "", "s", [], [1], ["s"], [[1]], {}, {"a": 1}]
ROUTES = {
    "/v1/completions": ({"model": MODEL, "prompt": "hi", "max_tokens": 1},
                        ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                         "stop_token_ids", "ignore_eos", "min_tokens", "n", "stream", "stream_options",
                         "user", "echo", "logprobs", "best_of", "presence_penalty", "frequency_penalty",
                         "repetition_penalty", "min_p", "logit_bias"]),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 1},
                             ["model", "messages", "max_tokens", "temperature", "top_p", "stop", "seed",
                              "n", "stream", "stream_options", "logprobs", "top_logprobs", "tools",
                              "response_format", "logit_bias"]),
    "/generate": ({"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                  ["text", "input_ids", "sampling_params", "stream", "model", "return_logprob",
                   "top_logprobs_num", "return_text_in_logprobs"]),
}


def test_no_500_for_any_field_type(tiny_server: ServerThread) -> None:
    """Every field of every route set to every JSON type: 200 or a 4xx in the OpenAI shape, never 500."""
    bad = []
    with requests.Session() as s:
        for route, (base, fields) in ROUTES.items():
            for f in fields:
                for v in WEIRD_VALUES:
                    r = s.post(tiny_server.url + route, json={**base, f: v}, timeout=30)
                    if r.status_code >= 500 or (r.status_code != 200 and set(r.json()) != {"error"}):
                        bad.append((route, f, v, r.status_code, r.text[:200]))
    assert not bad, bad
    assert requests.get(tiny_server.url + "/health", timeout=10).status_code == 200
    assert tiny_server.wait_idle()
