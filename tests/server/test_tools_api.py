"""Tool calling through the official `openai` client against a live server on the default model:
required and named choices (valid calls, by the tool's schema, from a 135M model), auto (well-formed
either way; the parsing itself is pinned in tools/test_tool_parser.py), each streamed and not (the
client's own stream accumulator rebuilds the same answer), a follow-up turn with the tool's result,
and the 400s, which queue nothing."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import requests
from openai.lib.streaming.chat import ChatCompletionStreamState

from appliance.server.schemas.openai import ChatCompletionChunk, ChatCompletionResponse

from tests.server.conftest import ServerThread

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(default_open_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_open_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def both(client: openai.OpenAI, **kw: Any) -> tuple[Any, Any]:
    """The answer, and the same request streamed as the client's accumulator rebuilds it."""
    plain = client.chat.completions.create(model=MODEL, temperature=0, **kw)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw):
        state.handle_chunk(chunk)
    return plain, state.current_completion_snapshot


def well_formed(choice: Any, names: set[str]) -> list[tuple[str, str]]:
    """OpenAI's shape of an answer that may call tools; returns its (name, arguments) pairs."""
    calls = choice.message.tool_calls or []
    content = choice.message.content
    assert content is None or ("<tool_call>" not in content and "</tool_call>" not in content)
    assert calls or content is not None
    if calls:
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert choice.finish_reason in ("stop", "length")
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        assert isinstance(c.function.arguments, str)
    return [(c.function.name, c.function.arguments) for c in calls]


def valid_calls(choice: Any, may_be_cut: bool = False) -> list[tuple[str, dict]]:
    """Each call's name is a tool's and its arguments are valid against that tool's parameters;
    `may_be_cut`: max_tokens may have cut the last one (finish_reason length), which is left out."""
    assert choice.finish_reason in (("tool_calls", "length") if may_be_cut else ("tool_calls",))
    assert choice.message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = choice.message.tool_calls
    out = []
    for c in calls[:-1] if choice.finish_reason == "length" else calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, schemas[c.function.name])
        out.append((c.function.name, args))
    return out


@pytest.mark.parametrize("parallel", [False, True])
def test_required_gives_valid_calls_streamed_and_not(client: openai.OpenAI, parallel: bool) -> None:
    plain, streamed = both(client, messages=ASK, tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=parallel, max_tokens=100)
    # In parallel, a 135M model tends to repeat its call until max_tokens (a length cut is no fault).
    calls = valid_calls(plain.choices[0], may_be_cut=parallel)
    assert valid_calls(streamed.choices[0], may_be_cut=parallel) == calls and len(calls) >= 1
    if not parallel:
        assert len(calls) == 1
    ids = [c.id for c in plain.choices[0].message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


def test_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    plain, streamed = both(client, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60)
    calls = valid_calls(plain.choices[0])
    assert valid_calls(streamed.choices[0]) == calls and [n for n, _ in calls] == ["get_time"]


def test_raw_answers_fit_the_response_models(default_open_server: ServerThread) -> None:
    """The JSON on the wire, not only what the client makes of it."""
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60,
            "temperature": 0, "parallel_tool_calls": False}
    r = requests.post(default_open_server.url + "/v1/chat/completions", json=body, timeout=300)
    answer = ChatCompletionResponse.model_validate(r.json())
    assert answer.choices[0].message.tool_calls and answer.choices[0].finish_reason == "tool_calls"
    r = requests.post(default_open_server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300)
    chunks = [ChatCompletionChunk.model_validate_json(line[6:]) for line in r.text.split("\n\n")
              if line.startswith("data: {")]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])  # later: arguments only
    assert "".join(d.function.arguments for d in deltas) == answer.choices[0].message.tool_calls[0].function.arguments
    assert all(not c.choices[0].delta.content for c in chunks)


def test_auto_streamed_and_not_give_one_well_formed_answer(client: openai.OpenAI) -> None:
    plain, streamed = both(client, messages=ASK, tools=TOOLS, max_tokens=60)
    names = {"get_weather", "get_time"}
    got = well_formed(plain.choices[0], names)
    assert well_formed(streamed.choices[0], names) == got
    assert streamed.choices[0].message.content == plain.choices[0].message.content
    assert streamed.choices[0].finish_reason == plain.choices[0].finish_reason


def test_tools_reach_the_prompt(client: openai.OpenAI) -> None:
    """The tools section is in the prompt the model sees (its usage counts it)."""
    without = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, tools=TOOLS)
    none = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, tools=TOOLS, tool_choice="none")
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50
    assert none.usage.prompt_tokens == without.usage.prompt_tokens  # "none": the tools stay out


def test_follow_up_turn_with_the_tool_result(client: openai.OpenAI) -> None:
    call = {"id": "call_abc123", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_abc123", "content": json.dumps({"temp_c": 21, "sky": "sunny"})}]
    plain, streamed = both(client, messages=messages, tools=TOOLS, max_tokens=40)
    assert well_formed(plain.choices[0], {"get_weather", "get_time"}) == \
        well_formed(streamed.choices[0], {"get_weather", "get_time"})
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    assert plain.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result were rendered


@pytest.mark.parametrize("kw, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [*ASK, {"role": "tool", "content": "21C"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client: openai.OpenAI, default_open_server: ServerThread, kw: dict,
                                                     param: str) -> None:
    body = {"messages": ASK, "max_tokens": 1, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, **body)
    err = e.value.response.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert default_open_server.engine.num_in_flight == 0 and not default_open_server.engine.engine.has_unfinished()


def few_shot(city: str) -> list[dict]:
    """Three earlier turns in which the assistant says a few words, then calls get_weather; the model
    copies the form for the last question (greedy), tags included."""
    msgs: list[dict] = []
    for i, c in enumerate(["Paris", "Rome", "Oslo"]):
        msgs += [{"role": "user", "content": f"What is the weather in {c}?"},
                 {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": f"call_{i}", "type": "function",
                  "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": "Sunny, 20 C"},
                 {"role": "assistant", "content": f"It is sunny in {c}."}]
    return msgs + [{"role": "user", "content": f"What is the weather in {city}?"}]


@pytest.fixture(scope="module")
def tag_server(tool_tag_model_dir) -> Any:
    from tests.server.conftest import start_server

    srv = start_server(f"model.path={tool_tag_model_dir}", "model.device=cpu")
    yield srv
    srv.stop()


def test_auto_reads_calls_whose_tags_are_special_tokens(tag_server: ServerThread) -> None:
    """`<tool_call>` / `</tool_call>` are special tokens of this tokenizer: the model generates them as
    single tokens, which plain text decoding drops; the parser still sees them, streamed and not, and
    the content keeps only the words around the call."""
    messages = few_shot("Madrid")
    tok = requests.post(tag_server.url + "/tokenize", json={"messages": messages, "tools": [WEATHER],
                                                             "return_token_strs": True}, timeout=60).json()
    assert tok["token_strs"].count("<tool_call>") == 2 + 3  # single tokens: the instructions, the calls
    client = openai.OpenAI(base_url=tag_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    kw = dict(messages=messages, tools=[WEATHER], max_tokens=40)
    for choice in both(client, **kw):
        assert choice.choices[0].finish_reason == "tool_calls"
        msg = choice.choices[0].message
        assert msg.content == "Let me check."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("get_weather", {"city": "Madrid"})]
    plain = client.chat.completions.create(model=MODEL, temperature=0, tool_choice="none", **kw)
    assert "<tool_call>" not in plain.choices[0].message.content  # without tools the tags stay skipped
    raw = client.chat.completions.create(model=MODEL, temperature=0, tool_choice="none", **kw,
                                         extra_body={"skip_special_tokens": False})
    assert "<tool_call>" in raw.choices[0].message.content
