"""A chat request's `tools` and `tool_choice`, checked and resolved into what the prompt, the sampler and
the parser need: the tools to render, the JSON schema that constrains `required` / named choices, and
whether the output is parsed for calls at all.

Defaults as OpenAI's: `tool_choice` is "auto" with tools and "none" without; `parallel_tool_calls` is
true. "none" leaves the tools out of the prompt and the text unparsed. Every bad value is a 400 naming
its field before anything is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from appliance.server.errors import bad_request
from appliance.server.schemas.openai import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolUse:
    """What a request with tools (and tool_choice other than "none") asks of the server."""

    tools: list[dict[str, Any]]  # the OpenAI tool objects, as the chat template takes them
    forced: bool  # required or named: the output is constrained to calls (`schema`)
    schema: Optional[dict[str, Any]] = None  # the calls' JSON schema when forced


def resolve_tools(req: ChatCompletionRequest) -> Optional[ToolUse]:
    """None when no tool may be called (no tools, or tool_choice "none")."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise bad_request("'tool_choice' is only allowed when 'tools' are specified.", "tool_choice")
        return None
    schemas = _check_tools(tools)
    if choice == "none":
        return None
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        return ToolUse(rendered, forced=False)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise bad_request(f"'tool_choice.function.name' names the function {name!r}, which is not in "
                              "'tools'.", "tool_choice.function.name")
        return ToolUse(rendered, forced=True, schema=_call_schema(name, schemas[name]))
    calls = [_call_schema(n, s) for n, s in schemas.items()]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if req.parallel_tool_calls is False:
        return ToolUse(rendered, forced=True, schema=one)
    return ToolUse(rendered, forced=True, schema={"type": "array", "items": one, "minItems": 1})


def _check_tools(tools: list[Tool]) -> dict[str, dict[str, Any]]:
    """name -> the arguments' schema; 400 for a repeated name or a schema that is none."""
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        f = t.function
        param = f"tools[{i}].function"
        if f.name in out:
            raise bad_request(f"'{param}.name' repeats the function name {f.name!r}.", param + ".name")
        schema = _NO_ARGUMENTS if f.parameters is None else f.parameters
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as e:
            raise bad_request(f"'{param}.parameters' is not a valid JSON schema: {e.message}",
                              param + ".parameters") from None
        except RecursionError:  # the meta-schema check recurses per level; JSON alone allows deeper
            raise bad_request(f"'{param}.parameters' is nested too deeply.", param + ".parameters") from None
        if schema.get("type", "object") != "object":
            raise bad_request(f"'{param}.parameters' must describe an object (its \"type\" is "
                              f"{json.dumps(schema['type'])}).", param + ".parameters")
        out[f.name] = schema
    return out


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """One call as the constrained output writes it: the name first, so the parser streams its arguments."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def check_messages(messages: list[ChatMessage]) -> None:
    """What the message model cannot say alone: who may carry tool_calls, tool_call_id and null content."""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"'{where}.tool_calls' is only allowed on assistant messages.", where + ".tool_calls")
        if m.role == "tool" and m.tool_call_id is None:
            raise bad_request(f"Missing required field '{where}.tool_call_id' (role tool).", where + ".tool_call_id")
        if m.tool_call_id is not None and m.role != "tool":
            raise bad_request(f"'{where}.tool_call_id' is only allowed on tool messages.", where + ".tool_call_id")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"Missing required field '{where}.content'; it may be null only on an assistant "
                              "message with tool_calls.", where + ".content")
