"""Structured outputs over HTTP on the default model (SmolLM2-135M-Instruct) with the shipped demo
adapters: every answer to a suite of JSON schemas parses and validates (jsonschema), with and without an
adapter, sent as one concurrent set so the engine batches constrained, free and adapter rows together;
the official `openai` client's response_format (json_schema, json_object, a pydantic model), vLLM's
guided_* fields, /generate's json_schema and regex, and 400s for grammars that do not compile."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Literal

import jsonschema
import openai
import pydantic
import pytest
import requests

from tests.conftest import shipped_config
from tests.server.conftest import ServerThread
from tests.server.structured_schemas import SCHEMAS

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def srv(default_model_dir) -> Iterator[ServerThread]:
    s = ServerThread(shipped_config("server.host=127.0.0.1", "server.port=0", f"model.path={default_model_dir}",
                                    "model.device=cpu", "model.max_model_len=1024", "engine.grammar_threads=1")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def ask(client: openai.OpenAI, model: str, name: str, schema: dict):
    return client.chat.completions.create(
        model=model, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": f"Give an example as JSON matching this schema: {json.dumps(schema)}"}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})


def test_every_schema_validates_with_and_without_an_adapter(client: openai.OpenAI) -> None:
    assert len(SCHEMAS) >= 20
    jobs = [(model, name, schema) for model in (MODEL, "pirate") for name, schema in SCHEMAS.items()]
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        free = pool.submit(client.chat.completions.create, model="french", max_tokens=8, temperature=0,
                           messages=[{"role": "user", "content": "Hello"}])
        answers = list(pool.map(lambda j: ask(client, *j), jobs))
    assert free.result().choices[0].message.content  # a free row beside them
    for (model, name, schema), out in zip(jobs, answers):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (model, name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


class Capital(pydantic.BaseModel):
    country: str = pydantic.Field(max_length=20)
    capital: str = pydantic.Field(max_length=20)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


def test_openai_client_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(model=MODEL, max_tokens=80, temperature=0, response_format=Capital,
                                        messages=[{"role": "user", "content": "What is the capital of France?"}])
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.capital == "Paris"  # the schema is followed, the answer kept


def test_json_object_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="pirate", max_tokens=120, temperature=0, stream=True, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a ship as a JSON object with a name and a size."}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_vllm_guided_fields(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    out = client.chat.completions.create(model=MODEL, max_tokens=10, messages=messages,
                                         extra_body={"guided_choice": ["yes", "no", "a.b (c)"]})
    assert out.choices[0].message.content in ("yes", "no", "a.b (c)")
    out = client.completions.create(model=MODEL, prompt="The year the war ended:", max_tokens=10,
                                    extra_body={"guided_regex": "[12][0-9]{3}"})
    assert re.fullmatch("[12][0-9]{3}", out.choices[0].text)
    schema = SCHEMAS["flat"]
    out = client.completions.create(model="french", prompt="A person as JSON:", max_tokens=60, temperature=0,
                                    extra_body={"guided_json": json.dumps(schema)})
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    out = client.completions.create(model=MODEL, prompt="Say it:", max_tokens=10,
                                    extra_body={"guided_grammar": 'root ::= "ok" | "fine"'})
    assert out.choices[0].text in ("ok", "fine")
    assert not out.model_extra or "ignored" not in json.dumps(out.model_extra)


def test_generate_json_schema_and_regex(srv: ServerThread) -> None:
    schema = SCHEMAS["array_ints"]
    r = requests.post(srv.url + "/generate", timeout=300, json={
        "text": ["Three small numbers as JSON:", "An ISO date:"],
        "sampling_params": [{"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(schema)},
                            {"max_new_tokens": 20, "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}]})
    assert r.status_code == 200, r.text
    first, second = r.json()
    jsonschema.validate(json.loads(first["text"]), schema)
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", second["text"])
    assert second["meta_info"]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
])
def test_bad_grammars_are_400s_naming_the_field(srv: ServerThread, body: dict, param: str) -> None:
    r = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert srv.wait_idle() and srv.engine.engine.num_waiting == 0


def test_generate_bad_regex_names_the_input(srv: ServerThread) -> None:
    r = requests.post(srv.url + "/generate", timeout=60, json={
        "text": ["a", "b"], "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 3, "regex": "[a-"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params[1].regex", r.text
