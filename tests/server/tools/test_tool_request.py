"""tools and tool_choice resolved into what the prompt, the grammar and the parser need: the schema of
required / named calls accepts exactly the calls OpenAI allows (checked with jsonschema)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from appliance.server.errors import ApiError
from appliance.server.schemas.openai import ChatCompletionRequest
from appliance.server.tools.request import resolve_tools

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "now"}}]


def resolved(**kw):
    return resolve_tools(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}))


def accepts(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except jsonschema.ValidationError:
        return False
    return True


W = '{"name": "weather", "arguments": {"city": "Oslo"}}'
N = '{"name": "now", "arguments": {}}'


@pytest.mark.parametrize("kw, good, bad", [
    ({"tool_choice": "required"}, [f"[{W}]", f"[{W}, {N}]"],
     ["[]", W, '[{"name": "weather", "arguments": {}}]', '[{"name": "now", "arguments": {"x": 1}}]',
      '[{"name": "other", "arguments": {}}]']),
    ({"tool_choice": "required", "parallel_tool_calls": False}, [W, N], [f"[{W}]", '{"name": "now"}']),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, [N], [W, f"[{N}]"]),
])
def test_forced_schemas(kw: dict, good: list[str], bad: list[str]) -> None:
    use = resolved(tools=TOOLS, **kw)
    assert use.forced and list(use.schema) and use.tools == TOOLS
    assert all(accepts(use.schema, t) for t in good) and not any(accepts(use.schema, t) for t in bad)


def test_auto_and_none() -> None:
    assert resolved(tools=TOOLS).forced is False and resolved(tools=TOOLS).schema is None
    assert resolved(tools=TOOLS, tool_choice="none") is None and resolved() is None
    assert resolved(tools=[], tool_choice="none") is None
    with pytest.raises(ApiError) as e:
        resolved(tool_choice="required")
    assert e.value.param == "tool_choice"


def test_a_schema_nested_past_the_checker_is_a_400() -> None:
    deep: dict = {}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ApiError) as e:
        resolved(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])
    assert e.value.param == "tools[0].function.parameters"
