"""Request and response models of the OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models.

The request models are what the routes validate (one `model_validate` per request, base.validate) and
what GET /openapi.json describes. Fields that OpenAI or vLLM define and this server does not implement
yet are declared, so the document names them, and refused with a 400 when set to anything but their
default (UNSUPPORTED_*): never silently ignored. The response models document the answers;
protocol.py builds them as plain dicts on the hot path, and tests/server check live answers against
these models.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, Field

from appliance.engine.request import MAX_LOGIT_BIAS, MAX_LOGPROBS
from appliance.server.schemas.base import Open, one_message

SEED_MAX = 2**63 - 1

ModelName = Annotated[str, Field(description="the base model's name, an adapter's name, or <base>:<adapter>")]
TokenIds = list[Annotated[int, Field(ge=0)]]
Number = Annotated[float, Field(allow_inf_nan=False)]
Stop = Annotated[Union[str, list[str]], one_message("must be a string or an array of strings."),
                 Field(description="stop strings (server.max_stop_strings, server.max_stop_chars)")]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]],
                      Field(max_length=MAX_LOGIT_BIAS, description="token id (a string) -> added to its logit")]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=256, description=(
    "(vLLM) prefix caching: only requests with the same salt share cached KV blocks"))]


class StreamOptions(Open):
    include_usage: Optional[bool] = Field(None, description="a last chunk with the usage, choices []")
    continuous_usage_stats: Optional[bool] = Field(
        None, description="(vLLM) the usage so far on every chunk")


class JsonSchemaFormat(Open):
    name: Optional[str] = Field(None, description="the schema's name (not used)")
    description: Optional[str] = Field(None, description="not used")
    schema_: Optional[Union[dict[str, Any], bool]] = Field(
        None, alias="schema", description="the JSON schema the output must validate against")
    strict: Optional[bool] = Field(None, description="accepted; the output always follows the schema")


class ResponseFormat(Open):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(None, description='with type "json_schema"')


class Sampling(Open):
    """The sampling fields both OpenAI routes take (null = absent)."""

    model: ModelName
    temperature: Optional[Number] = Field(None, ge=0)
    top_p: Optional[Number] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, description="(vLLM) -1 or 0 = off")
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX)
    min_tokens: Optional[int] = Field(None, ge=0, description="(vLLM)")
    ignore_eos: Optional[bool] = Field(None, description="(vLLM)")
    stop: Optional[Stop] = None
    stop_token_ids: Optional[TokenIds] = Field(None, description="(vLLM)")
    n: Optional[int] = Field(None, ge=1, description="samples per prompt; they share the prompt's KV")
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = Field(None, description="only with stream: true")
    user: Optional[str] = Field(None, description="accepted; not used")
    logit_bias: Optional[LogitBias] = None
    presence_penalty: Optional[Penalty] = Field(None, description="minus this once per token already generated")
    frequency_penalty: Optional[Penalty] = Field(None, description="minus this times the token's count so far")
    repetition_penalty: Optional[Number] = Field(None, gt=0, description="(vLLM) CTRL/HF, over prompt and output")
    min_p: Optional[Number] = Field(None, ge=0, le=1, description="(vLLM) relative to the top token's probability")
    cache_salt: Optional[CacheSalt] = None
    skip_special_tokens: Optional[bool] = Field(
        None, description="(vLLM) default true: special tokens are left out of the text (tool-call tags that "
                          "are special tokens stay while the answer is parsed for calls)")
    # Structured outputs (server/grammar_params.py): at most one of these five.
    response_format: Optional[ResponseFormat] = Field(None, description="text, json_object or json_schema")
    guided_json: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="(vLLM) a JSON schema, as an object or as JSON text")
    guided_regex: Optional[str] = Field(None, description="(vLLM) a regex the whole output matches")
    guided_choice: Optional[Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]] = Field(
        None, description="(vLLM) the output is exactly one of these strings")
    guided_grammar: Optional[str] = Field(None, description="(vLLM) an EBNF grammar (xgrammar's, root rule `root`)")


CompletionPrompt = Annotated[
    Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
          Annotated[TokenIds, Field(min_length=1)], Annotated[list[Annotated[TokenIds, Field(min_length=1)]],
                                                              Field(min_length=1)]],
    one_message("must be a string, an array of strings, an array of token ids, or an array of arrays of "
                "token ids (and not empty)."),
]


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    prompt: CompletionPrompt
    max_tokens: Optional[int] = Field(None, ge=1, description="default 16, capped to the context left")
    echo: Optional[bool] = Field(None, description="the prompt's text before each choice's text; not with logprobs")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="the k most likely tokens too")
    best_of: Optional[int] = Field(None, ge=1, description=">= n; the n of highest cumulative logprob; not streamed")
    suffix: Optional[str] = Field(None, description='not supported (only "")')


class TextPart(Open):
    type: Literal["text"]
    text: str


Content = Annotated[Union[str, list[TextPart]],
                    one_message('must be a string or an array of {"type": "text", "text": <string>} parts; '
                                "only text content is supported.")]


class FunctionCall(Open):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(Open):
    """A call the assistant made in an earlier turn (the `tool_calls` of an answer, sent back)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Open):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description='"developer" = "system"')
    content: Optional[Content] = Field(None, description="required, except null on an assistant turn with tool_calls")
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="assistant turns only")
    tool_call_id: Optional[str] = Field(None, description="role tool: the id of the call this answers")


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="a-z, A-Z, 0-9, _ and -, at most 64")]


class FunctionDefinition(Open):
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(
        None, description="a JSON schema of the arguments object; absent = no arguments")
    strict: Optional[bool] = Field(None, description="accepted; required and named tool_choice are always "
                                                     "constrained to the schema, auto never")


class Tool(Open):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Open):
    name: str


class NamedToolChoice(Open):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Annotated[Union[Literal["none", "auto", "required"], NamedToolChoice],
                       one_message('must be "none", "auto", "required" or {"type": "function", "function": '
                                   '{"name": <string>}}.')]


ChatTemplateKwargs = Annotated[dict[str, Any], Field(
    description="(vLLM) extra variables the chat template reads (e.g. enable_thinking); not the ones the server "
                "sets (messages, tools, add_generation_prompt, ...)")]


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions: `messages` rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[int] = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="wins over max_tokens")
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    tools: Optional[list[Tool]] = Field(None, description="functions the model may call (server/tools/)")
    tool_choice: Optional[ToolChoice] = Field(None, description='default "auto" with tools, else "none"')
    parallel_tool_calls: Optional[bool] = Field(None, description="default true: required may call several")
    audio: Optional[dict[str, Any]] = Field(None, description="not supported")
    modalities: Optional[list[str]] = Field(None, description='only ["text"]')
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None
    add_generation_prompt: Optional[bool] = Field(None, description="(vLLM) default true (false with "
                                                                    "continue_final_message)")
    continue_final_message: Optional[bool] = Field(
        None, description="(vLLM) the last message is left open and the answer continues it")
    add_special_tokens: Optional[bool] = Field(
        None, description="(vLLM) default false: the tokenizer's BOS etc. on top of what the template writes")


def _never(v: Any) -> bool:
    return False


def _equals(default: Any) -> Callable[[Any], bool]:
    return lambda v: v == default


_SHARED: dict[str, Callable[[Any], bool]] = {}
UNSUPPORTED_COMPLETION = {**_SHARED, "suffix": _equals("")}
UNSUPPORTED_CHAT = {**_SHARED, "audio": _never, "modalities": _equals(["text"])}


# ------------------------------------------------------------------------------------------ responses

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Optional[Literal["stop", "length"]]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int] = Field(description="from the completion's start")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = Field(None, description="on a stream: null but on the last chunk (include_usage)")


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="JSON text as the model wrote it (auto: check it before use)")


class ToolCallOut(BaseModel):
    id: str = Field(description="call_<hex>")
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str] = Field(description="null when the answer is only tool calls")
    tool_calls: Optional[list[ToolCallOut]] = Field(None, description="present when the model called tools")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


ChatFinishReason = Optional[Literal["stop", "length", "tool_calls"]]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: ChatFinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallDelta(BaseModel):
    """A call's first delta carries index, id, type and function.name; later ones argument fragments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionCallDelta] = None


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: ChatFinishReason


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a chat stream; the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: Optional[str]
    max_model_len: Optional[int] = Field(None, description="the base model's card only")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
