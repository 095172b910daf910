"""/tokenize, /detokenize, /version and the probes (/ready, /health_generate) against a live server: the tiny
random model (the default model's tokenizer and chat template) with LoRA on and one adapter loaded.
Oracles: transformers' tokenizer and chat template; the usage a chat completion reports; the engine's
own state (stopped, draining) for the probes."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import openai
import pytest
import requests
from transformers import AutoTokenizer

import appliance
from tests.lora.test_lora_engine import make_adapter
from tests.server.conftest import ServerThread, start_with_adapter
from tests.server.engine_hold import engine_held

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List 3 countries."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("util-adapters")
    make_adapter(tiny_model_dir, root / "ad", seed=5, r=4, lora_alpha=8, target_modules=["q_proj"])
    s = start_with_adapter(tiny_model_dir, root, "ad", "util-admin", "model.max_model_len=256",
                           "server.health_generate_timeout_s=2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def post(srv: ServerThread, path: str, body: dict) -> requests.Response:
    return requests.post(srv.url + path, json=body, timeout=60)


@pytest.mark.parametrize("model", [None, MODEL, "ad", f"{MODEL}:ad"])
def test_tokenize_prompt_matches_transformers(srv: ServerThread, hf, model: str | None) -> None:
    text = "The capital of France is Paris."
    body = {"prompt": text, **({"model": model} if model else {})}
    r = post(srv, "/tokenize", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == hf(text).input_ids and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256 and out["token_strs"] is None
    r = post(srv, "/tokenize", {**body, "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["tokens"] == hf(text, add_special_tokens=False).input_ids
    assert r.json()["token_strs"] == hf.convert_ids_to_tokens(r.json()["tokens"])


def test_tokenize_messages_is_what_chat_is_charged(srv: ServerThread, hf) -> None:
    r = post(srv, "/tokenize", {"model": "ad", "messages": CHAT})
    assert r.status_code == 200, r.text
    ref = hf(hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
             add_special_tokens=False).input_ids
    assert r.json()["tokens"] == ref
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="ad", messages=CHAT, max_tokens=1)
    assert chat.usage.prompt_tokens == r.json()["count"]
    bare = post(srv, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert bare == hf(hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False),
                      add_special_tokens=False).input_ids


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tokenize_messages_with_tools_is_what_chat_with_tools_is_charged(srv: ServerThread, choice: str) -> None:
    with_tools = post(srv, "/tokenize", {"messages": CHAT, "tools": [WEATHER]})
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["count"] > post(srv, "/tokenize", {"messages": CHAT}).json()["count"]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice=choice,
                                          max_tokens=1)
    assert chat.usage.prompt_tokens == with_tools.json()["count"]


def test_template_options_reach_tokenize_and_chat_alike(srv: ServerThread, hf) -> None:
    """continue_final_message leaves the last turn open (transformers' rendering); chat_template_kwargs
    pass through; a chat request with the same options is charged the same count."""
    turns = CHAT + [{"role": "assistant", "content": "France, Spain and"}]
    opts = {"continue_final_message": True, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}}
    r = post(srv, "/tokenize", {"messages": turns, **opts})
    assert r.status_code == 200, r.text
    ref = hf(hf.apply_chat_template(turns, tokenize=False, continue_final_message=True), add_special_tokens=False)
    assert r.json()["tokens"] == ref.input_ids and hf.decode(ref.input_ids).endswith("France, Spain and")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=1, extra_body=opts)
    assert chat.usage.prompt_tokens == r.json()["count"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=turns, max_tokens=1,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert e.value.response.json()["error"]["param"] == "continue_final_message"


def test_detokenize_round_trip(srv: ServerThread, hf) -> None:
    text = "Grüße, 世界! <|im_start|>"
    ids = hf(text, add_special_tokens=False).input_ids
    for model in (None, "ad"):
        r = post(srv, "/detokenize", {"tokens": ids, **({"model": model} if model else {})})
        assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids)}, r.text
    assert r.json()["prompt"] == text


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "tools": [WEATHER]}, 400, "tools"),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs.tools"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs.tokenize"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "extra": 1}, 400, "extra"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other:ad"}, 404, "model"),
])
def test_bad_utility_requests(srv: ServerThread, path: str, body: dict, status: int, param: str) -> None:
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


def test_version(srv: ServerThread) -> None:
    r = requests.get(srv.url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": appliance.__version__}


def test_health_generate_makes_a_token(srv: ServerThread) -> None:
    r = requests.get(srv.url + "/health_generate", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
    assert srv.wait_idle()


def test_health_generate_is_503_when_no_token_comes(srv: ServerThread) -> None:
    """The engine thread held between steps (as a stuck forward would): /health stays 200, the deep
    probe answers 503 after server.health_generate_timeout_s (2 s), and 200 again once it steps."""
    with engine_held(srv.engine):
        t0 = time.monotonic()
        r = requests.get(srv.url + "/health_generate", timeout=30)
        waited = time.monotonic() - t0
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    assert r.status_code == 503 and r.json()["error"]["code"] == "generate_timeout", r.text
    assert waited >= 2
    assert srv.wait_idle()  # the probe's request was aborted
    assert requests.get(srv.url + "/health_generate", timeout=30).status_code == 200


def test_concurrent_probes_share_one_generation(srv: ServerThread) -> None:
    results: list[int] = []
    with engine_held(srv.engine):
        threads = [threading.Thread(target=lambda: results.append(
            requests.get(srv.url + "/health_generate", timeout=30).status_code)) for _ in range(5)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while srv.engine.num_in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert srv.engine.num_in_flight == 1
    for t in threads:
        t.join(30)
    assert results == [200] * 5


def test_ready_follows_the_server_state(srv: ServerThread) -> None:
    """/ready: 200 once listening (run.py sets `started`), 503 before and while draining (what SIGTERM
    sets, tests/server/test_shutdown.py), while /health answers liveness only."""
    state = srv.server.state
    assert requests.get(srv.url + "/ready", timeout=10).status_code == 200
    try:
        state.started = False
        r = requests.get(srv.url + "/ready", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200  # alive, not ready
        state.started, state.draining = True, True
        for path in ("/ready", "/health_generate"):
            r = requests.get(srv.url + path, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining", (path, r.text)
    finally:
        state.started, state.draining = True, False
    assert requests.get(srv.url + "/ready", timeout=10).status_code == 200


def test_admin_answers_fit_their_models(srv: ServerThread) -> None:
    """The admin routes' answers are what /openapi.json documents (schemas/admin.py)."""
    from appliance.server.schemas.admin import AdapterChange, AdapterList, AdapterUnloaded
    from tests.server.test_schemas import fits

    admin = {"Authorization": "Bearer util-admin"}
    fits(AdapterList, requests.get(srv.url + "/v1/adapters", headers=admin, timeout=30).json())
    path = requests.get(srv.url + "/v1/adapters", headers=admin, timeout=30).json()["data"][0]["path"]
    r = requests.post(srv.url + "/load_lora_adapter", headers=admin, timeout=60,
                      json={"lora_name": "ad2", "lora_path": path, "pinned": True})
    fits(AdapterChange, r.json())
    fits(AdapterChange, requests.post(srv.url + "/pin_lora_adapter", headers=admin, timeout=60,
                                      json={"lora_name": "ad2", "pinned": False}).json())
    fits(AdapterList, requests.get(srv.url + "/v1/adapters", headers=admin, timeout=30).json())
    fits(AdapterUnloaded, requests.post(srv.url + "/unload_lora_adapter", headers=admin, timeout=60,
                                        json={"lora_name": "ad2"}).json())
