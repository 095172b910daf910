"""Template options through a real tokenizer whose template reads an extra variable (as Qwen3's reads
enable_thinking): chat_template_kwargs reach it, the server's own variables cannot be overridden."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.tokenizer import Tokenizer
from appliance.server.chat_template import TemplateOptions, chat_prompt, template_options
from appliance.server.errors import ApiError
from appliance.server.schemas.openai import ChatMessage
from tests.conftest import tokenizer_dir_with_template

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or not continue_final_message %}"
            "|{% endif %}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = [ChatMessage(role="user", content="Hi")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir_with_template(tmp_path_factory.mktemp("kwtok"), default_model_dir, TEMPLATE))


def render(tok: Tokenizer, options: TemplateOptions, messages: list[ChatMessage] = CHAT) -> str:
    return tok.decode(chat_prompt(messages, tok, options), skip_special_tokens=False)


def test_kwargs_reach_the_template(tok: Tokenizer) -> None:
    assert render(tok, TemplateOptions()) == "<user>Hi|<assistant>"
    opts = template_options(None, None, None, {"enable_thinking": True}, tok)
    assert render(tok, opts) == "<user>Hi|<think><assistant>"


def test_continue_final_message_leaves_the_last_turn_open(tok: Tokenizer) -> None:
    opts = template_options(None, True, None, None, tok)
    assert not opts.add_generation_prompt
    assert render(tok, opts, CHAT + [ChatMessage(role="assistant", content="Hello th")]) == "<user>Hi|<assistant>Hello th"


@pytest.mark.parametrize("args, param", [
    ((True, True, None, None), "continue_final_message"),
    ((None, None, None, {"messages": []}), "chat_template_kwargs.messages"),
    ((None, None, None, {"add_generation_prompt": False}), "chat_template_kwargs.add_generation_prompt"),
    ((None, None, None, {"tokenize": True}), "chat_template_kwargs.tokenize"),
    ((None, None, None, {"chat_template": "{{ 1 }}"}), "chat_template_kwargs.chat_template"),
])
def test_contradictions_and_server_variables_are_400s(tok: Tokenizer, args: tuple, param: str) -> None:
    with pytest.raises(ApiError) as e:
        template_options(*args, tok)
    assert e.value.status == 400 and e.value.param == param
