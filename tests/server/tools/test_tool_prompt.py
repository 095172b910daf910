"""Tools, calls and results through the real tokenizer's chat template: the default model's (no tools:
Hermes text) and a copy of it whose template reads `tools` (transformers' tool-use shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.engine.tokenizer import Tokenizer
from appliance.server.chat_template import chat_prompt
from appliance.server.schemas.openai import ChatMessage
from appliance.server.tools.prompt import TOOLS_FOOTER, TOOLS_HEADER
from tests.conftest import tokenizer_dir_with_template

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TURNS = [{"role": "user", "content": "Weather in Paris and Rome?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2", "function": {
             "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
         {"role": "tool", "tool_call_id": "call_2", "content": "25C"}]

# A template in the tool-use shape of Qwen2.5's: it reads `tools` and each call's arguments as a dict.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}({{ t.function.parameters | tojson }});"
    "{% endfor %}|{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% endif %}")


def messages(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def tool_tok(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir_with_template(tmp_path_factory.mktemp("tooltok"), default_model_dir, TOOL_TEMPLATE))


def test_default_template_gets_the_hermes_convention(tok: Tokenizer) -> None:
    assert not tok.supports_tools
    text = tok.decode(chat_prompt(messages(TURNS), tok, tools=[TOOL]), skip_special_tokens=False)
    section = TOOLS_HEADER + json.dumps(TOOL) + TOOLS_FOOTER
    assert text == (
        f"<|im_start|>system\n{section}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n<tool_response>\n25C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_system_message_keeps_its_text_before_the_tools(tok: Tokenizer) -> None:
    text = tok.decode(chat_prompt(messages([{"role": "system", "content": "Be brief."}, TURNS[0]]), tok,
                                  tools=[TOOL]), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and text.count("<|im_start|>system") == 1


def test_without_tools_the_prompt_is_unchanged(tok: Tokenizer) -> None:
    plain = [{"role": "user", "content": "Hi", "name": "ann"}]
    assert chat_prompt(messages(plain), tok) == tok.apply_chat_template(plain)


def test_a_template_that_reads_tools_gets_them(tool_tok: Tokenizer) -> None:
    assert tool_tok.supports_tools
    text = tool_tok.decode(chat_prompt(messages(TURNS), tool_tok, tools=[TOOL]), skip_special_tokens=False)
    assert text == ('TOOLS:get_weather({"type": "object", "properties": {"city": {"type": "string"}}});|'
                    "<user>Weather in Paris and Rome?|"
                    "<assistant>[get_weather city=Paris][get_weather city=Rome]|"
                    "<tool>21C#call_1|<tool>25C#call_2|<assistant>")
