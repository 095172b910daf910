"""The pydantic models (appliance/server/schemas/) against a live server with the tiny random model: the
document at /openapi.json is the one generated from them, live answers fit the response models, and
unknown fields are warned about (default) or refused (server.strict_fields)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import openai
import pytest
import requests
from pydantic import BaseModel

from appliance.server.openapi import build_openapi
from appliance.server.schemas.admin import LoadLoRAAdapterRequest
from appliance.server.schemas.native import GenerateItem, GenerateRequest
from appliance.server.schemas.openai import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                             CompletionRequest, CompletionResponse, ModelList)
from appliance.server.schemas.utility import TokenizeRequest
from tests.server.conftest import ServerThread, start_server

MODEL = "tiny"
CHAT = [{"role": "user", "content": "hi"}]
HEADER = "x-appliance-ignored-fields"


@pytest.fixture(scope="module")
def client(tiny_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def fits(model: type[BaseModel], data: object) -> None:
    """`data` is exactly what `model` describes: validates, and dumps back to itself."""
    parsed = model.model_validate(data, strict=True)
    assert parsed.model_dump(exclude_unset=True) == data


def test_openapi_is_generated_from_the_models(tiny_server: ServerThread) -> None:
    doc = requests.get(tiny_server.url + "/openapi.json", timeout=30).json()
    routes = tiny_server.server.config.app.routes
    assert doc == json.loads(json.dumps(build_openapi(routes, tiny_server.cfg)))
    schemas = doc["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest, GenerateRequest, LoadLoRAAdapterRequest, TokenizeRequest):
        own = model.model_json_schema(ref_template="#/components/schemas/{model}")
        nested = own.pop("$defs", {})
        assert schemas[model.__name__] == own and all(schemas[k] == v for k, v in nested.items())
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    # Fields that are refused are still described, so a client sees them.
    assert {"logprobs", "tools", "min_p", "guided_json"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert schemas["GenerateRequest"]["additionalProperties"] is False


def test_answers_fit_the_response_models(tiny_server: ServerThread) -> None:
    url = tiny_server.url
    fits(ModelList, requests.get(url + "/v1/models", timeout=30).json())
    r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 3},
                      timeout=60)
    fits(CompletionResponse, r.json())
    r = requests.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3},
                      timeout=60)
    fits(ChatCompletionResponse, r.json())
    fits(GenerateItem, requests.post(url + "/generate", json={"text": "a"}, timeout=60).json())
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        fits(ChatCompletionChunk, json.loads(e))


def test_unknown_field_is_served_with_a_warning(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="appliance.server.app"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"frobnicate": 1, "zz_top": {"a": 1}})
    assert raw.http_response.status_code == 200
    assert raw.headers[HEADER] == "frobnicate,zz_top"
    assert raw.parse().choices[0].message.content is not None
    lines = [r.getMessage() for r in caplog.records if "ignored unknown field" in r.getMessage()]
    assert len(lines) == 1 and "frobnicate,zz_top" in lines[0], lines
    # Nested unknown keys are named by their path; known fields only: no header.
    r = requests.post(client.base_url.join("completions").__str__(), timeout=60, json={
        "model": MODEL, "prompt": "a", "max_tokens": 1, "stream": True,
        "stream_options": {"include_usage": True, "sparkle": 1}})
    assert r.status_code == 200 and r.headers[HEADER] == "stream_options.sparkle"
    plain = client.completions.with_raw_response.create(model=MODEL, prompt="a", max_tokens=1)
    assert HEADER not in plain.headers


def test_hostile_unknown_field_names_stay_one_header(tiny_server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1, "a\r\nSet-Cookie: x": 1, "é" * 500: 2,
            **{f"k{i}": i for i in range(40)}}
    r = requests.post(tiny_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    value = r.headers[HEADER]
    assert "set-cookie" not in {k.lower() for k in r.headers} and value.isascii() and len(value) < 2000
    assert value.endswith(",+26")  # 16 named, the rest counted


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy"}),
    ("modalities", ["text", "audio"]),
])
def test_unimplemented_fields_are_refused(client: openai.OpenAI, field: str, value: object) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={field: value})
    err = e.value.response.json()["error"]
    assert err["param"] == field, err


def test_harmless_fields_at_their_defaults_are_accepted(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=1, user="u1", parallel_tool_calls=False, n=1,
        extra_body={"repetition_penalty": 1.0, "min_p": 0, "chat_template_kwargs": {}, "tools": []})
    assert raw.http_response.status_code == 200 and HEADER not in raw.headers


def test_continuous_usage_stats(tiny_server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = requests.post(tiny_server.url + "/v1/completions", json=body, timeout=60)
    chunks = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and all(c["usage"] for c in chunks)


@pytest.fixture(scope="module")
def strict(tiny_model_dir: Path) -> Iterator[ServerThread]:
    srv = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=128",
                       "model.device=cpu", "server.strict_fields=true")
    yield srv
    srv.stop()


def test_strict_mode_refuses_unknown_fields(strict: ServerThread) -> None:
    c = openai.OpenAI(base_url=strict.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"frobnicate": 1})
    err = e.value.response.json()["error"]
    assert err["param"] == "frobnicate" and "server.strict_fields" in err["message"], err
    r = requests.post(strict.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi", "mood": "ok"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].mood", r.text
    assert c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).choices
