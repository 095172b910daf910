"""Models of the utility routes (/tokenize, /detokenize, /version, the probes) and of the error every
route may answer."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, Field

from appliance.server.schemas.base import Closed
from appliance.server.schemas.openai import ChatMessage, ChatTemplateKwargs, TokenIds, Tool


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """The OpenAI error shape (errors.py), for every error of every route."""

    error: ErrorDetail


class Status(BaseModel):
    """/health, /ready, /health_generate: 200 with this, else 503 with the error shape."""

    status: Literal["ok"]


class TokenizeRequest(Closed):
    """POST /tokenize (vLLM's shape): exactly one of `prompt` and `messages`."""

    model: Optional[str] = Field(None, description="the base model or an adapter (they share the tokenizer)")
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(
        None, description="rendered with the model's chat template")
    add_special_tokens: Optional[bool] = Field(
        None, description="add the tokenizer's BOS etc.; default true for prompt, false for messages (the "
                          "template writes them)")
    add_generation_prompt: Optional[bool] = Field(None, description="messages only; default true (false with "
                                                                    "continue_final_message)")
    continue_final_message: Optional[bool] = Field(None, description="messages only: the last message left open")
    tools: Optional[list[Tool]] = Field(None, description="messages only: rendered as a chat request with these "
                                                          "tools (tool_choice auto) renders them")
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None
    return_token_strs: Optional[bool] = Field(None, description="also each token as the vocabulary writes it")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(Closed):
    """POST /detokenize (vLLM's shape)."""

    model: Optional[str] = Field(None, description="the base model or an adapter (they share the tokenizer)")
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str = Field(description="the appliance package's version")
