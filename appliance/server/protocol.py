"""Request parsing and response building for the OpenAI routes and the native /generate.

Parsing reads the JSON body (json.loads, then a check for unpaired surrogates), validates it with one
`model_validate` of the route's pydantic model (server/schemas/: types, ranges, shapes; every problem
a 400 naming its field), then checks what the model cannot know (the context length, the vocabulary,
the server.* bounds) and turns it into `Job`s (token ids + SamplingParams, one per choice), so bad
input never reaches the engine as an exception.

Unknown top-level fields of the OpenAI routes are listed in `ParsedRequest.ignored_fields` (the app
logs them and answers them in a header) or, with server.strict_fields, refused; known OpenAI/vLLM
features this server does not implement are refused when set to anything but their default.
/generate is our own API and refuses unknown keys.

Default max_tokens (when the request sends none): /v1/completions 16 (OpenAI's default),
/v1/chat/completions the rest of the context (like vLLM), /generate 128 (SGLang's default); the
defaults are capped to what the context has left.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from appliance.engine.grammar.spec import GrammarSpec
from appliance.engine.request import RequestError, RequestOutput, SamplingParams, TokenLogprob
from appliance.engine.tokenizer import Tokenizer
from appliance.lora.names import cut
from appliance.server import logprob_format
from appliance.server.chat_template import chat_prompt, template_options
from appliance.server.errors import bad_request
from appliance.server.grammar_params import generate_grammar, openai_grammar
from appliance.server.schemas.base import extra_fields, json_type, refuse_unsupported, unknown_field_error, validate
from appliance.server.schemas.native import GenerateRequest, GenerateSamplingParams
from appliance.server.tools import parser as tool_parser
from appliance.server.tools.request import ToolUse, resolve_tools
from appliance.server.schemas.openai import (UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION, ChatCompletionRequest,
                                             ChatMessage, CompletionRequest, Sampling)

COMPLETION_DEFAULT_MAX_TOKENS = 16
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class Job:
    """One engine request: one choice of an OpenAI response, or one item of a /generate batch."""

    prompt_ids: list[int]
    params: SamplingParams
    # The adapter as the client named it (`model` / `lora_path`), set once the app checked it exists;
    # None = base. The engine resolves it again when it takes the request.
    adapter: Optional[str] = None
    # Another sample of an earlier job's prompt (`n`, `best_of`): that job's index; it shares its KV.
    prompt_source: Optional[int] = None


@dataclass
class ParsedRequest:
    model: Optional[str]  # None only for /generate without `model` (= the base model)
    jobs: list[Job]
    stream: bool
    include_usage: bool = False  # stream_options.include_usage
    batched: bool = False  # /generate: the input was a list, so the answer is a list
    lora_paths: Optional[list[Optional[str]]] = None  # /generate `lora_path`, one per job (null = base)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM): usage on every chunk
    ignored_fields: list[str] = field(default_factory=list)  # unknown fields, not acted on (strict off)
    logprob_text: bool = False  # /generate return_text_in_logprobs
    n: int = 1  # choices per prompt (server/samples.py)
    best_of: int = 1  # samples per prompt, >= n; the n best are returned
    tool_use: Optional[ToolUse] = None  # chat with tools callable: the text is parsed for calls (server/tools/)
    echo: Optional[list[str]] = None  # completions `echo`: each prompt's text, written before its choices' text

    def echo_of(self, choice: int, per_prompt: int) -> str:
        """The echoed prompt text of a choice, with `per_prompt` choices per prompt ("" without echo)."""
        return "" if self.echo is None else self.echo[choice // per_prompt]


@dataclass
class Choice:
    """What one job produced, accumulated from the engine's RequestOutput deltas."""

    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: Optional[str] = None  # the engine's: stop | length | abort | error
    error: Optional[str] = None  # the engine's message when finish_reason == "error"
    logprobs: Optional[list[TokenLogprob]] = None  # one per token when the request asked, else None
    logprobs_sent: int = 0  # a stream: how many of them went out in chunks (logprob_format.take)
    logprob_chars: int = 0  # a stream: the completion's text_offset after those
    counts_prompt: bool = True  # False for the 2nd..nth sample of a prompt: usage counts a prompt once
    last: Optional[RequestOutput] = None  # the engine's final update: its timestamps make the trace spans


# ------------------------------------------------------------------------------------------ JSON body

def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {json_type(body)}.")
    _reject_lone_surrogates(body)
    return body


def _reject_lone_surrogates(body: dict[str, Any]) -> None:
    """400 for any string (value or key, at any depth) holding an unpaired UTF-16 surrogate.

    JSON's `\\ud800` escape decodes to a str that is no text: it cannot be encoded as UTF-8, so the
    tokenizer, the chat template, logging or the JSON answer echoing it would fail deep inside the
    server (a 500). Refused here, where it enters, naming the field. Iterative, and each field's path
    is a chain of (parent, step) built into a string only for the error: the body's depth is bounded
    only by the JSON parser's recursion limit, and its keys by the body size.
    """
    _Path = Optional[tuple]  # (parent path, key or index), None = the body
    stack: list[tuple[Any, _Path]] = [(body, None)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                if not _is_text(k):
                    where = _path_str(path)
                    raise bad_request(f"A field name in {'the body' if where is None else repr(where)} is not "
                                      "valid Unicode text (an unpaired surrogate escape such as \\ud800).", where)
                stack.append((x, (path, k)))
        elif isinstance(v, list):
            stack.extend((x, (path, i)) for i, x in enumerate(v))
        elif isinstance(v, str) and not _is_text(v):
            where = _path_str(path)
            raise bad_request(f"'{where}' is not valid Unicode text (an unpaired surrogate escape such as "
                              "\\ud800).", where)


def _path_str(path: Optional[tuple]) -> Optional[str]:
    """`messages[0].content` for a (parent, step) chain; None for the body itself. Each key is cut
    (lora/names.cut), so a long key does not come back whole."""
    steps: list[str] = []
    while path is not None:
        path, step = path
        steps.append(f"[{step}]" if isinstance(step, int) else f".{cut(step)}")
    if not steps:
        return None
    return "".join(reversed(steps)).lstrip(".")


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


# ------------------------------------------------------------------------------------------ checks
# What the models cannot know: the tokenizer, the context length and the server.* bounds.

def _stop(stop: Union[str, list[str], None], param: str, limits: "RequestLimits") -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if any(s == "" for s in stops):
        raise bad_request(f"'{param}' must not contain empty strings.", param)
    # The engine checks every stop string against the tail of the text after each token: bound that work.
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"'{param}' holds {len(stops)} strings; at most {limits.max_stop_strings} are allowed "
                          "(server.max_stop_strings).", param)
    total = sum(len(s) for s in stops)
    if total > limits.max_stop_chars:
        raise bad_request(f"'{param}' holds {total} characters; at most {limits.max_stop_chars} are allowed "
                          "in all (server.max_stop_chars).", param)
    return list(stops)


def in_vocab(ids: list[int], param: str, vocab_size: int) -> list[int]:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise bad_request(f"'{param}' holds token ids outside the vocabulary [0, {vocab_size}): "
                          f"{bad[:5]}.", param)
    return ids


# ------------------------------------------------------------------------------------------ sampling

@dataclass(frozen=True)
class RequestLimits:
    """What parsing checks a request against: the model's context and the server.* bounds."""

    tokenizer: Tokenizer
    max_model_len: int
    max_stop_strings: int = 16  # server.max_stop_strings
    max_stop_chars: int = 1024  # server.max_stop_chars: all stop strings of one prompt together
    max_prompts: int = 256  # server.max_prompts_per_request
    strict_fields: bool = False  # server.strict_fields: unknown fields are a 400


def _logit_bias(bias: Optional[dict[str, float]], param: str, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids as strings (count and values checked by the model)."""
    out: dict[int, float] = {}
    for k, b in (bias or {}).items():
        tid = int(k) if k.isascii() and k.isdigit() else -1
        if not 0 <= tid < vocab_size:
            raise bad_request(f"'{param}' keys must be token ids in [0, {vocab_size}), got {cut(k)!r}.", param)
        out[tid] = b
    return out


def _sampling(d: Union[Sampling, GenerateSamplingParams], limits: RequestLimits, *, prefix: str,
              max_tokens: Optional[int], max_tokens_param: str,
              min_tokens: Optional[int], min_tokens_key: str,
              logprobs: Optional[int] = None) -> Callable[[int, int], SamplingParams]:
    """The sampling fields shared by every route (types and ranges checked by the model); returns a
    factory (prompt_len, default) -> params. max_tokens is resolved per prompt because its default
    and its check depend on the prompt length. `logprobs`: the route's own logprobs field, read by
    the caller (SamplingParams.logprobs)."""
    p = prefix
    stop = _stop(d.stop, p + "stop", limits)
    stop_ids = ([] if d.stop_token_ids is None
                else in_vocab(d.stop_token_ids, p + "stop_token_ids", limits.tokenizer.vocab_size))
    temperature, top_p, top_k, seed, ignore_eos = d.temperature, d.top_p, d.top_k, d.seed, d.ignore_eos
    extra: dict[str, Any] = {"logprobs": logprobs,
                             "logit_bias": _logit_bias(d.logit_bias, p + "logit_bias", limits.tokenizer.vocab_size)}
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "cache_salt",
                "skip_special_tokens"):
        if getattr(d, key, None) is not None:
            extra[key] = getattr(d, key)
    extra["grammar"] = (generate_grammar(d, p) if isinstance(d, GenerateSamplingParams)
                        else openai_grammar(d))

    def build(prompt_len: int, default_max_tokens: int) -> SamplingParams:
        room = limits.max_model_len - prompt_len
        n = min(default_max_tokens, room) if max_tokens is None else max_tokens
        if n > room:
            raise bad_request(
                f"This model's maximum context length is {limits.max_model_len} tokens; the prompt has "
                f"{prompt_len} tokens and '{max_tokens_param}' asks for {n} more.", max_tokens_param)
        if min_tokens is not None and min_tokens > n:
            raise bad_request(f"'{p}{min_tokens_key}' ({min_tokens}) must not exceed "
                              f"'{max_tokens_param}' ({n}).", p + min_tokens_key)
        params = SamplingParams(max_tokens=n, stop=stop, stop_token_ids=stop_ids, seed=seed,
                                ignore_eos=bool(ignore_eos), min_tokens=min_tokens or 0, **extra)
        if temperature is not None:
            params.temperature = temperature
        if top_p is not None:
            params.top_p = top_p
        if top_k is not None:
            params.top_k = top_k
        try:
            params.validate()
        except RequestError as e:
            raise bad_request(str(e), e.param) from None
        return params

    return build


def _check_prompt_count(n: int, limits: RequestLimits, param: str) -> None:
    """Before any prompt is tokenized: a request may carry at most server.max_prompts_per_request."""
    if n > limits.max_prompts:
        raise bad_request(f"'{param}' holds {n} prompts; at most {limits.max_prompts} are allowed in one "
                          "request (server.max_prompts_per_request).", param)


def _check_prompt_len(ids: list[int], limits: RequestLimits, param: str) -> None:
    if not ids:
        raise bad_request(f"'{param}' must not be empty.", param)
    if len(ids) >= limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens, and the prompt has "
            f"{len(ids)} tokens (at least one token must be left to generate).", param)


def _samples(n: Optional[int], best_of: Optional[int], stream: bool, prompts: int,
             limits: RequestLimits) -> tuple[int, int]:
    """`n` and `best_of` (server/samples.py): best_of >= n, not streamed when above n, and at most
    server.max_prompts_per_request samples in all."""
    n = n or 1
    if best_of is not None and best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be >= 'n' ({n}).", "best_of")
    best_of = best_of or n
    if best_of > n and stream:
        raise bad_request("'best_of' greater than 'n' cannot be streamed (the best are known at the end).", "best_of")
    if best_of * prompts > limits.max_prompts:
        raise bad_request(f"The request asks for {best_of * prompts} samples; at most {limits.max_prompts} are "
                          "allowed in one request (server.max_prompts_per_request).",
                          "best_of" if best_of > n else "n")
    return n, best_of


def _openai_common(req: Sampling, table: dict, limits: RequestLimits) -> tuple[bool, bool, bool, list[str]]:
    """Checks both OpenAI routes share: unsupported fields refused, unknown ones listed (strict mode
    refuses them); returns stream, include_usage, continuous_usage_stats and the unknown fields."""
    refuse_unsupported(req, table)
    unknown = extra_fields(req)
    if unknown and limits.strict_fields:
        raise unknown_field_error(unknown)
    stream = bool(req.stream)
    opts = req.stream_options
    if opts is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    return (stream, bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats), unknown)


# ------------------------------------------------------------------------------------------ routes

def parse_completion(body: dict, limits: RequestLimits) -> ParsedRequest:
    """POST /v1/completions: `prompt` is a string, strings, token ids, or lists of token ids."""
    req = validate(CompletionRequest, body, "/v1/completions")
    stream, include_usage, continuous, unknown = _openai_common(req, UNSUPPORTED_COMPLETION, limits)
    build = _sampling(req, limits, prefix="", max_tokens=req.max_tokens, max_tokens_param="max_tokens",
                      min_tokens=req.min_tokens, min_tokens_key="min_tokens", logprobs=req.logprobs)
    prompts = _completion_prompts(req.prompt, limits)
    n, best_of = _samples(req.n, req.best_of, stream, len(prompts), limits)
    jobs = []
    for ids in prompts:
        _check_prompt_len(ids, limits, "prompt")
        jobs.append(Job(ids, build(len(ids), COMPLETION_DEFAULT_MAX_TOKENS)))
    echo = None
    if req.echo:
        if req.logprobs is not None:  # vLLM answers the prompt's logprobs then, which this server does not compute
            raise bad_request("'echo' with 'logprobs' (the prompt's logprobs) is not supported.", "echo")
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt if isinstance(req.prompt[0], str) else None
        echo = texts if texts is not None else [limits.tokenizer.decode(ids, skip_special_tokens=False)
                                                for ids in prompts]
    return ParsedRequest(req.model, jobs, stream, include_usage, continuous_usage=continuous,
                         ignored_fields=unknown, n=n, best_of=best_of, echo=echo)


def _completion_prompts(prompt: Union[str, list], limits: RequestLimits) -> list[list[int]]:
    tokenizer = limits.tokenizer
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt[0], int):  # one prompt's token ids
        return [in_vocab(prompt, "prompt", tokenizer.vocab_size)]
    _check_prompt_count(len(prompt), limits, "prompt")
    if isinstance(prompt[0], str):
        return [tokenizer.encode(p) for p in prompt]
    return [in_vocab(p, "prompt", tokenizer.vocab_size) for p in prompt]


def parse_chat(body: dict, limits: RequestLimits) -> ParsedRequest:
    """POST /v1/chat/completions: `messages` rendered with the model's chat template."""
    req = validate(ChatCompletionRequest, body, "/v1/chat/completions")
    stream, include_usage, continuous, unknown = _openai_common(req, UNSUPPORTED_CHAT, limits)
    max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = req.max_tokens, "max_tokens"
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
    build = _sampling(req, limits, prefix="", max_tokens=max_tokens, max_tokens_param=param,
                      min_tokens=req.min_tokens, min_tokens_key="min_tokens",
                      logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    n, _ = _samples(req.n, None, stream, 1, limits)
    tool_use = resolve_tools(req)
    options = template_options(req.add_generation_prompt, req.continue_final_message, req.add_special_tokens,
                               req.chat_template_kwargs, limits.tokenizer)
    ids = chat_prompt(req.messages, limits.tokenizer, options, tools=tool_use.tools if tool_use else None)
    _check_prompt_len(ids, limits, "messages")
    params = build(len(ids), limits.max_model_len)
    if tool_use is not None:  # tags that are special tokens stay in the text the tool parser reads
        params.kept_special_token_ids = limits.tokenizer.special_ids_of((tool_parser.OPEN, tool_parser.CLOSE))
    if tool_use is not None and tool_use.schema is not None:  # required / named: the calls are constrained
        if params.grammar is not None:
            raise bad_request(f"'{params.grammar.param}' cannot be combined with 'tool_choice' \"required\" or a "
                              "named function (both constrain the output).", params.grammar.param)
        params.grammar = GrammarSpec.json_schema(tool_use.schema, "tools")
        try:
            params.validate()
        except RequestError as e:
            raise bad_request(str(e), e.param) from None
    return ParsedRequest(req.model, [Job(ids, params)], stream, include_usage,
                         continuous_usage=continuous, ignored_fields=unknown, n=n, best_of=n, tool_use=tool_use)


def parse_generate(body: dict, limits: RequestLimits) -> ParsedRequest:
    """POST /generate (SGLang-style): `text` or `input_ids`, single or batch, plus `sampling_params` and
    `lora_path` (the adapter per input)."""
    tokenizer = limits.tokenizer
    req = validate(GenerateRequest, body, "/generate")
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("Send exactly one of 'text' and 'input_ids'.", "text")
    if req.text is not None:
        batched = isinstance(req.text, list)
        texts = req.text if isinstance(req.text, list) else [req.text]
        _check_prompt_count(len(texts), limits, "text")
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        ids = req.input_ids
        batched = isinstance(ids[0], list)
        raw = ids if batched else [ids]
        _check_prompt_count(len(raw), limits, "input_ids")
        prompts = [in_vocab(x, "input_ids", tokenizer.vocab_size) for x in raw]
    sp = req.sampling_params
    if sp is None:
        sps = [GenerateSamplingParams()] * len(prompts)
    elif not isinstance(sp, list):
        sps = [sp] * len(prompts)
    elif batched and len(sp) == len(prompts):
        sps = sp
    else:
        raise bad_request("'sampling_params' must be an object, or (for a batch) an array of one "
                          "object per input.", "sampling_params")
    jobs = []
    for i, (ids, s) in enumerate(zip(prompts, sps)):
        prefix = f"sampling_params[{i}]." if isinstance(sp, list) else "sampling_params."
        build = _sampling(s, limits, prefix=prefix, max_tokens=s.max_new_tokens,
                          max_tokens_param=prefix + "max_new_tokens", min_tokens=s.min_new_tokens,
                          min_tokens_key="min_new_tokens",
                          logprobs=(req.top_logprobs_num or 0) if req.return_logprob else None)
        _check_prompt_len(ids, limits, "text" if req.text is not None else "input_ids")
        jobs.append(Job(ids, build(len(ids), GENERATE_DEFAULT_MAX_NEW_TOKENS)))
    return ParsedRequest(req.model, jobs, bool(req.stream), batched=batched,
                         lora_paths=_lora_paths(req.lora_path, len(jobs), batched),
                         logprob_text=bool(req.return_text_in_logprobs))


def _lora_paths(v: Union[str, list[Optional[str]], None], n: int, batched: bool) -> Optional[list[Optional[str]]]:
    """/generate `lora_path` (SGLang): an adapter name for every input, or (batch) one per input."""
    if v is None:
        return None
    if isinstance(v, str):
        return [v] * n
    if batched and len(v) == n:
        return list(v)
    raise bad_request("'lora_path' must be an adapter name, null, or (for a batch) an array of one "
                      f"adapter name or null per input ({n}).", "lora_path")


# ------------------------------------------------------------------------------------------ responses

def usage(choices: list[Choice]) -> dict[str, int]:
    p = sum(c.prompt_tokens for c in choices if c.counts_prompt)
    c = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_response(rid: str, created: int, model: str, choices: list[Choice],
                        tok: Optional[logprob_format.Decoder] = None,
                        sampled: Optional[list[Choice]] = None, echo: Optional[list[str]] = None) -> dict:
    """`tok` decodes the tokens of logprobs (needed when a choice has them); `sampled`: every sample
    behind `choices` (best_of), which usage counts; `echo`: the text before each choice's (echo)."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": c.text if echo is None else echo[i] + c.text,
                     "logprobs": None if c.logprobs is None else logprob_format.completion(tok, c.logprobs),  # type: ignore[arg-type]
                     "finish_reason": c.finish_reason}
                    for i, c in enumerate(choices)],
        "usage": usage(choices if sampled is None else sampled),
    }


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: Optional[str], include_usage: bool, logprobs: Optional[dict] = None) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None  # as OpenAI: null on every chunk but the last
    return chunk


def chat_response(rid: str, created: int, model: str, choices: list[Choice],
                  tok: Optional[logprob_format.Decoder] = None, sampled: Optional[list[Choice]] = None,
                  tool_use: Optional[ToolUse] = None) -> dict:
    """`tool_use`: the text is parsed for tool calls (the message's tool_calls, finish_reason tool_calls)."""
    out = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if tool_use is not None:
            content, calls = tool_parser.parse(c.text, tool_use.forced)
            message["content"] = content
            if calls:
                message["tool_calls"] = [tool_call(call) for call in calls]
            finish = tool_finish_reason(finish, bool(calls))
        out.append({"index": i, "message": message,
                    "logprobs": None if c.logprobs is None else logprob_format.chat(tok, c.logprobs),  # type: ignore[arg-type]
                    "finish_reason": finish})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage(choices if sampled is None else sampled)}


def tool_call(call: tool_parser.Call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_delta(d: tool_parser.Delta) -> dict:
    """A chat chunk's delta for what the tool-call parser let out of one update ({} for nothing)."""
    delta: dict[str, Any] = {"content": d.content} if d.content else {}
    if d.calls:
        calls = []
        for c in d.calls:
            fn: dict[str, str] = {"arguments": c.arguments}
            item: dict[str, Any] = {"index": c.index}
            if c.id is not None:
                item.update(id=c.id, type="function")
                fn = {"name": c.name or "", "arguments": c.arguments}
            item["function"] = fn
            calls.append(item)
        delta["tool_calls"] = calls
    return delta


def tool_finish_reason(finish: Optional[str], called: bool) -> Optional[str]:
    """OpenAI's "tool_calls" for an answer that ended with calls; a cut-short one stays "length"."""
    return "tool_calls" if called and finish == "stop" else finish


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               finish_reason: Optional[str], include_usage: bool, logprobs: Optional[dict] = None) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(obj: str, rid: str, created: int, model: str, choices: list[Choice]) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(choices)}


def generate_item(rid: str, choice: Choice, logprob_text: Optional[logprob_format.Decoder] = None) -> dict:
    """One /generate result; in a stream, `text` and `output_ids` are cumulative (SGLang's format).
    `logprob_text`: the decoder that fills the logprobs' text (return_text_in_logprobs), else null."""
    return {"text": choice.text, "output_ids": list(choice.token_ids), "meta_info": _meta(rid, choice, logprob_text)}


def _meta(rid: str, choice: Choice, logprob_text: Optional[logprob_format.Decoder]) -> dict:
    meta = {"id": rid, "prompt_tokens": choice.prompt_tokens, "completion_tokens": choice.completion_tokens,
            "finish_reason": choice.finish_reason}
    if choice.logprobs is not None:
        meta.update(logprob_format.generate(logprob_text, choice.logprobs))
    return meta


# One encoder for every event: building one per call costs about as much as encoding a small chunk.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(data: dict) -> str:
    return f"data: {_encode(data)}\n\n"


class GenerateEvents:
    """The SSE events of one streamed /generate: `generate_item` plus `index` per update, with each
    choice's cumulative `output_ids` kept encoded and extended by the new ids (encoding the whole list
    on every event makes a stream quadratic in its length; logprobs, when asked, are re-encoded)."""

    def __init__(self, n: int, logprob_text: Optional[logprob_format.Decoder] = None) -> None:
        self._ids = [""] * n
        self._logprob_text = logprob_text

    def event(self, rid: str, index: int, choice: Choice, new_ids: list[int]) -> str:
        if new_ids:
            add = ",".join(map(str, new_ids))
            self._ids[index] = f"{self._ids[index]},{add}" if self._ids[index] else add
        meta = _encode(_meta(rid, choice, self._logprob_text))
        return (f'data: {{"text":{_encode(choice.text)},"output_ids":[{self._ids[index]}],'
                f'"meta_info":{meta},"index":{index}}}\n\n')


SSE_DONE = "data: [DONE]\n\n"
