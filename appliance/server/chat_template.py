"""Chat messages into prompt token ids through the model's chat template, with the template options
vLLM's chat requests take (`add_generation_prompt`, `continue_final_message`, `add_special_tokens`,
`chat_template_kwargs`). /v1/chat/completions and /tokenize both render here, so /tokenize counts
what a chat request prefills."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

from jinja2 import TemplateError

from appliance.engine.tokenizer import Tokenizer
from appliance.server.errors import bad_request
from appliance.server.schemas.openai import ChatMessage
from appliance.server.tools import prompt as tool_prompt
from appliance.server.tools.request import check_messages


@dataclass(frozen=True)
class TemplateOptions:
    add_generation_prompt: bool = True  # the reply's opening (e.g. `<|im_start|>assistant\n`)
    continue_final_message: bool = False  # the last (assistant) message left open, to be continued
    add_special_tokens: bool = False  # the tokenizer's BOS etc. on top of what the template writes
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables (e.g. enable_thinking)


def template_options(add_generation_prompt: Optional[bool], continue_final_message: Optional[bool],
                     add_special_tokens: Optional[bool], kwargs: Optional[dict[str, Any]],
                     tokenizer: Tokenizer) -> TemplateOptions:
    """The request's options with their defaults; a 400 naming the field for a contradiction or a
    template variable the server sets itself."""
    cont = bool(continue_final_message)
    if cont and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                          "continue_final_message")
    kwargs = kwargs or {}
    reserved = _reserved(tokenizer)
    for key in kwargs:
        if key in reserved:
            raise bad_request(f"'chat_template_kwargs.{key}' is set by the server (use the request field of that "
                              "name, if any).", f"chat_template_kwargs.{key}")
    return TemplateOptions(add_generation_prompt=not cont if add_generation_prompt is None else add_generation_prompt,
                           continue_final_message=cont, add_special_tokens=bool(add_special_tokens), kwargs=kwargs)


def _reserved(tokenizer: Tokenizer) -> set[str]:
    """Names apply_chat_template takes as its own parameters, plus the template's `messages`."""
    hf = getattr(tokenizer, "hf", None)
    names = set() if hf is None else {p for p in inspect.signature(hf.apply_chat_template).parameters
                                      if p not in ("kwargs",)}
    return names | {"messages", "conversation", "tools", "documents", "add_generation_prompt",
                    "continue_final_message", "tokenize", "chat_template"}


def chat_prompt(messages: list[ChatMessage], tokenizer: Tokenizer, options: TemplateOptions = TemplateOptions(),
                tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """The token ids of `messages` (and `tools`) rendered by the model's chat template; tool turns and
    tools in the Hermes convention when the template knows no tools."""
    if not tokenizer.has_chat_template:
        raise bad_request("This model has no chat template; use /v1/completions.", "messages")
    check_messages(messages)
    uses_tools = bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
    if uses_tools and not tokenizer.supports_tools:
        rendered, tools = tool_prompt.hermes(messages, tools), None
    else:
        rendered = tool_prompt.native(messages)
    try:
        return tokenizer.apply_chat_template(rendered, options.add_generation_prompt, options.add_special_tokens,
                                             tools=tools, continue_final_message=options.continue_final_message,
                                             **options.kwargs)
    except (TemplateError, ValueError) as e:  # e.g. a template that insists roles alternate
        raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None
