"""Chat messages (with tool calls and tool results) and tools as the chat template takes them.

A template that reads `tools` (Qwen2.5, Hermes, Llama 3.1, Mistral fine-tunes) gets them as they are, and
the messages in transformers' tool-use shape (`tool_calls` with the arguments as a dict, role `tool`).
A template that does not (the default SmolLM2-135M-Instruct) gets the Hermes convention in plain
messages: a system section that lists the tools and asks for `<tool_call>{..}</tool_call>`, earlier calls
written the same way in the assistant's text, and tool results as a user turn in `<tool_response>` tags
(the format Qwen/Hermes-style fine-tunes are trained on; docs/tool-calling.md).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from appliance.server.schemas.openai import ChatMessage, ToolCall

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    return m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)


def _arguments(text: str) -> Any:
    """A call's arguments as templates index them (a dict); text that is no JSON object stays text."""
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if isinstance(v, dict) else text


def native(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """transformers' chat shape, for a template that knows tools (or a request without any)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": ROLES[m.role], "content": _text(m)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def hermes(messages: list[ChatMessage], tools: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Plain system/user/assistant messages that carry the tools, calls and results as Hermes text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = ROLES[m.role]
        if role == "tool":
            block = f"<tool_response>\n{_text(m)}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        content = _text(m)
        if m.tool_calls:
            content = "\n".join([content] * bool(content) + [_call_text(c) for c in m.tool_calls])
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    for msg in out:
        msg.pop("tool_results", None)
    if tools:
        section = TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _call_text(c: ToolCall) -> str:
    call = {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
