"""Request parsing and response building for the OpenAI routes and the native /generate.

Parsing turns a JSON body into `Job`s (token ids + SamplingParams, one per choice) with plain typed
checks: every problem is an `ApiError` 400 that names the field, so bad input never reaches the
engine as an exception. Unknown top-level fields of the OpenAI routes are ignored (clients send
extras); known OpenAI features this server does not implement are refused when set to anything but
their default. /generate is our own API and refuses unknown keys.

Default max_tokens (when the request sends none): /v1/completions 16 (OpenAI's default),
/v1/chat/completions the rest of the context (like vLLM), /generate 128 (SGLang's default); the
defaults are capped to what the context has left.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from jinja2 import TemplateError

from appliance.engine.request import RequestError, SamplingParams
from appliance.engine.tokenizer import Tokenizer
from appliance.lora.names import cut, shown
from appliance.server.errors import bad_request, unknown_fields

COMPLETION_DEFAULT_MAX_TOKENS = 16
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128
_SEED_MAX = 2**63 - 1

# OpenAI fields we do not implement: refused unless absent or set to one of these default values.
_COMPLETION_UNSUPPORTED: dict[str, tuple] = {
    "echo": (None, False), "logprobs": (None,), "best_of": (None, 1), "suffix": (None, ""),
    "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
}
_CHAT_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "tools": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
    "audio": (None,), "modalities": (None, ["text"]),
}
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "stream", "model", "lora_path"}
_GENERATE_SAMPLING_KEYS = {"max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop",
                           "stop_token_ids", "seed", "ignore_eos"}


@dataclass
class Job:
    """One engine request: one choice of an OpenAI response, or one item of a /generate batch."""

    prompt_ids: list[int]
    params: SamplingParams
    # The adapter as the client named it (`model` / `lora_path`), set once the app checked it exists;
    # None = base. The engine resolves it again when it takes the request.
    adapter: Optional[str] = None


@dataclass
class ParsedRequest:
    model: Optional[str]  # None only for /generate without `model` (= the base model)
    jobs: list[Job]
    stream: bool
    include_usage: bool = False  # stream_options.include_usage
    batched: bool = False  # /generate: the input was a list, so the answer is a list
    lora_paths: Optional[list[Optional[str]]] = None  # /generate `lora_path`, one per job (null = base)


@dataclass
class Choice:
    """What one job produced, accumulated from the engine's RequestOutput deltas."""

    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: Optional[str] = None  # the engine's: stop | length | abort | error
    error: Optional[str] = None  # the engine's message when finish_reason == "error"


# ------------------------------------------------------------------------------------------ JSON body

def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {_json_type(body)}.")
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


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


# ------------------------------------------------------------------------------------------ typed fields
# JSON null counts as absent (OpenAI clients send explicit nulls).

def _int(d: dict, key: str, param: str) -> Optional[int]:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{param}' must be an integer, got {_json_type(v)}.", param)
    return v


def _number(d: dict, key: str, param: str) -> Optional[float]:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{param}' must be a number, got {_json_type(v)}.", param)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise bad_request(f"'{param}' must be a finite number.", param)
    return f


def opt_bool(d: dict, key: str, param: str) -> Optional[bool]:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad_request(f"'{param}' must be a boolean, got {_json_type(v)}.", param)
    return v


def _str(d: dict, key: str, param: str) -> Optional[str]:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(f"'{param}' must be a string, got {_json_type(v)}.", param)
    return v


def _stop(d: dict, key: str, param: str, limits: "RequestLimits") -> list[str]:
    v = d.get(key)
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"'{param}' must be a string or an array of strings.", param)
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


def _token_ids(v: Any, param: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(f"'{param}' must be an array of integer token ids.", param)
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"'{param}' holds token ids outside the vocabulary [0, {vocab_size}): "
                          f"{bad[:5]}.", param)
    return list(v)


def _check_unsupported(body: dict, table: dict[str, tuple]) -> None:
    for key, allowed in table.items():
        if key in body and body[key] not in allowed:
            raise bad_request(f"'{key}' is not supported by this server.", key)


# ------------------------------------------------------------------------------------------ sampling

@dataclass(frozen=True)
class RequestLimits:
    """What parsing checks a request against: the model's context and the server.* bounds."""

    tokenizer: Tokenizer
    max_model_len: int
    max_stop_strings: int = 16  # server.max_stop_strings
    max_stop_chars: int = 1024  # server.max_stop_chars: all stop strings of one prompt together
    max_prompts: int = 256  # server.max_prompts_per_request


def _sampling(d: dict, limits: RequestLimits, *, prefix: str, max_tokens: Optional[int],
              max_tokens_param: str, min_tokens_key: str) -> Callable[[int, int], SamplingParams]:
    """Read the sampling fields shared by every route; return a factory (prompt_len, default) -> params.

    max_tokens is resolved per prompt because its default and its check depend on the prompt length.
    """
    p = prefix
    temperature = _number(d, "temperature", p + "temperature")
    top_p = _number(d, "top_p", p + "top_p")
    top_k = _int(d, "top_k", p + "top_k")
    seed = _int(d, "seed", p + "seed")
    min_tokens = _int(d, min_tokens_key, p + min_tokens_key)
    ignore_eos = opt_bool(d, "ignore_eos", p + "ignore_eos")
    stop = _stop(d, "stop", p + "stop", limits)
    stop_ids_raw = d.get("stop_token_ids")
    stop_ids = ([] if stop_ids_raw is None
                else _token_ids(stop_ids_raw, p + "stop_token_ids", limits.tokenizer.vocab_size))
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'{max_tokens_param}' must be >= 1, got {max_tokens}.", max_tokens_param)
    if temperature is not None and temperature < 0:
        raise bad_request(f"'{p}temperature' must be >= 0, got {temperature}.", p + "temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad_request(f"'{p}top_p' must be in (0, 1], got {top_p}.", p + "top_p")
    if top_k is not None and top_k < -1:
        raise bad_request(f"'{p}top_k' must be -1 or 0 (off) or >= 1, got {top_k}.", p + "top_k")
    if seed is not None and not 0 <= seed <= _SEED_MAX:
        raise bad_request(f"'{p}seed' must be in [0, 2**63 - 1], got {seed}.", p + "seed")
    if min_tokens is not None and min_tokens < 0:
        raise bad_request(f"'{p}{min_tokens_key}' must be >= 0, got {min_tokens}.", p + min_tokens_key)

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
                                ignore_eos=bool(ignore_eos), min_tokens=min_tokens or 0)
        if temperature is not None:
            params.temperature = temperature
        if top_p is not None:
            params.top_p = top_p
        if top_k is not None:
            params.top_k = top_k
        try:
            params.validate()
        except RequestError as e:
            raise bad_request(str(e)) from None
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


def _n_and_stream(body: dict) -> tuple[bool, bool]:
    n = _int(body, "n", "n")
    if n is not None and n != 1:
        raise bad_request(f"'n' must be 1 (only one choice per prompt is supported), got {n}.", "n")
    _str(body, "user", "user")  # accepted and ignored, but typed
    stream = bool(opt_bool(body, "stream", "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object.", "stream_options")
        include_usage = bool(opt_bool(opts, "include_usage", "stream_options.include_usage"))
    return stream, include_usage


def _model(body: dict) -> str:
    model = _str(body, "model", "model")
    if model is None:
        raise bad_request("Missing required field 'model'.", "model")
    return model


# ------------------------------------------------------------------------------------------ routes

def parse_completion(body: dict, limits: RequestLimits) -> ParsedRequest:
    """POST /v1/completions: `prompt` is a string, strings, token ids, or lists of token ids."""
    model = _model(body)
    _check_unsupported(body, _COMPLETION_UNSUPPORTED)
    stream, include_usage = _n_and_stream(body)
    build = _sampling(body, limits, prefix="", max_tokens=_int(body, "max_tokens", "max_tokens"),
                      max_tokens_param="max_tokens", min_tokens_key="min_tokens")
    prompts = _completion_prompts(body.get("prompt"), limits)
    jobs = []
    for ids in prompts:
        _check_prompt_len(ids, limits, "prompt")
        jobs.append(Job(ids, build(len(ids), COMPLETION_DEFAULT_MAX_TOKENS)))
    return ParsedRequest(model, jobs, stream, include_usage)


def _completion_prompts(prompt: Any, limits: RequestLimits) -> list[list[int]]:
    tokenizer = limits.tokenizer
    if prompt is None:
        raise bad_request("Missing required field 'prompt'.", "prompt")
    if isinstance(prompt, str):
        return [_encode_text(prompt, tokenizer, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("'prompt' must be a string, an array of strings, an array of token ids, "
                          "or an array of arrays of token ids (and not empty).", "prompt")
    if not all(isinstance(p, int) for p in prompt):  # a list of prompts, not one prompt's token ids
        _check_prompt_count(len(prompt), limits, "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [_encode_text(p, tokenizer, "prompt") for p in prompt]
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [_token_ids(prompt, "prompt", tokenizer.vocab_size)]
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p, "prompt", tokenizer.vocab_size) for p in prompt]
    raise bad_request("'prompt' mixes types: use strings, token ids, or arrays of token ids.", "prompt")


def _encode_text(text: str, tokenizer: Tokenizer, param: str) -> list[int]:
    if text == "":
        raise bad_request(f"'{param}' must not be empty.", param)
    return tokenizer.encode(text)


def parse_chat(body: dict, limits: RequestLimits) -> ParsedRequest:
    """POST /v1/chat/completions: `messages` rendered with the model's chat template."""
    tokenizer, max_model_len = limits.tokenizer, limits.max_model_len
    model = _model(body)
    _check_unsupported(body, _CHAT_UNSUPPORTED)
    stream, include_usage = _n_and_stream(body)
    max_tokens = _int(body, "max_completion_tokens", "max_completion_tokens")
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", "max_tokens")
        param = "max_tokens"
    build = _sampling(body, limits, prefix="", max_tokens=max_tokens, max_tokens_param=param,
                      min_tokens_key="min_tokens")
    messages = _messages(body.get("messages"))
    if not tokenizer.has_chat_template:
        raise bad_request("This model has no chat template; use /v1/completions.", "messages")
    try:
        ids = tokenizer.apply_chat_template(messages)
    except (TemplateError, ValueError) as e:  # e.g. a template that insists roles alternate
        raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None
    _check_prompt_len(ids, limits, "messages")
    return ParsedRequest(model, [Job(ids, build(len(ids), max_model_len))], stream, include_usage)


def _messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise bad_request("Missing required field 'messages'.", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{param}' must be an object.", param)
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise bad_request(f"'{param}.role' must be one of {sorted(_CHAT_ROLES)}, got {shown(role) if isinstance(role, str) else _json_type(role)}.",
                              param + ".role")
        msg = {"role": _CHAT_ROLES[role], "content": _content(m.get("content"), param + ".content")}
        name = _str(m, "name", param + ".name")
        if name is not None:
            msg["name"] = name
        out.append(msg)
    return out


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array of text parts.", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"'{param}[{j}]' must be {{\"type\": \"text\", \"text\": <string>}}; "
                              "only text content is supported.", f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_generate(body: dict, limits: RequestLimits) -> ParsedRequest:
    """POST /generate (SGLang-style): `text` or `input_ids`, single or batch, plus `sampling_params` and
    `lora_path` (the adapter per input)."""
    tokenizer = limits.tokenizer
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise unknown_fields(unknown, _GENERATE_KEYS, "/generate")
    model = _str(body, "model", "model")
    stream = bool(opt_bool(body, "stream", "stream"))
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise bad_request("Send exactly one of 'text' and 'input_ids'.", "text")
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise bad_request("'text' must be a string or a non-empty array of strings.", "text")
        _check_prompt_count(len(texts), limits, "text")
        prompts = [_encode_text(t, tokenizer, "text") for t in texts]
    else:
        batched = isinstance(input_ids, list) and bool(input_ids) and all(isinstance(x, list)
                                                                           for x in input_ids)
        raw = input_ids if batched else [input_ids]
        _check_prompt_count(len(raw), limits, "input_ids")
        prompts = [_token_ids(x, "input_ids", tokenizer.vocab_size) for x in raw]
    sp = body.get("sampling_params")
    if sp is None:
        sps = [{}] * len(prompts)
    elif isinstance(sp, dict):
        sps = [sp] * len(prompts)
    elif isinstance(sp, list) and batched and len(sp) == len(prompts) and all(isinstance(s, dict)
                                                                               for s in sp):
        sps = sp
    else:
        raise bad_request("'sampling_params' must be an object, or (for a batch) an array of one "
                          "object per input.", "sampling_params")
    jobs = []
    for i, (ids, s) in enumerate(zip(prompts, sps)):
        prefix = f"sampling_params[{i}]." if isinstance(sp, list) else "sampling_params."
        unknown = sorted(set(s) - _GENERATE_SAMPLING_KEYS)
        if unknown:
            raise unknown_fields([prefix + k for k in unknown], _GENERATE_SAMPLING_KEYS, f"'{prefix[:-1]}'")
        build = _sampling(s, limits, prefix=prefix,
                          max_tokens=_int(s, "max_new_tokens", prefix + "max_new_tokens"),
                          max_tokens_param=prefix + "max_new_tokens", min_tokens_key="min_new_tokens")
        _check_prompt_len(ids, limits, "text" if text is not None else "input_ids")
        jobs.append(Job(ids, build(len(ids), GENERATE_DEFAULT_MAX_NEW_TOKENS)))
    return ParsedRequest(model, jobs, stream, batched=batched,
                         lora_paths=_lora_paths(body.get("lora_path"), len(jobs), batched))


def _lora_paths(v: Any, n: int, batched: bool) -> Optional[list[Optional[str]]]:
    """/generate `lora_path` (SGLang): an adapter name for every input, or (batch) one per input."""
    if v is None:
        return None
    if isinstance(v, str):
        return [v] * n
    if isinstance(v, list) and batched and len(v) == n and all(x is None or isinstance(x, str) for x in v):
        return list(v)
    raise bad_request("'lora_path' must be an adapter name, null, or (for a batch) an array of one "
                      f"adapter name or null per input ({n}).", "lora_path")


# ------------------------------------------------------------------------------------------ responses

def usage(choices: list[Choice]) -> dict[str, int]:
    p = sum(c.prompt_tokens for c in choices)
    c = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_response(rid: str, created: int, model: str, choices: list[Choice]) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                    for i, c in enumerate(choices)],
        "usage": usage(choices),
    }


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: Optional[str], include_usage: bool) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": None,
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None  # as OpenAI: null on every chunk but the last
    return chunk


def chat_response(rid: str, created: int, model: str, choices: list[Choice]) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                     "logprobs": None, "finish_reason": c.finish_reason}
                    for i, c in enumerate(choices)],
        "usage": usage(choices),
    }


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               finish_reason: Optional[str], include_usage: bool) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": None,
                          "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(obj: str, rid: str, created: int, model: str, choices: list[Choice]) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(choices)}


def generate_item(rid: str, choice: Choice) -> dict:
    """One /generate result; in a stream, `text` and `output_ids` are cumulative (SGLang's format)."""
    return {"text": choice.text, "output_ids": list(choice.token_ids),
            "meta_info": {"id": rid, "prompt_tokens": choice.prompt_tokens,
                          "completion_tokens": choice.completion_tokens,
                          "finish_reason": choice.finish_reason}}


# One encoder for every event: building one per call costs about as much as encoding a small chunk.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(data: dict) -> str:
    return f"data: {_encode(data)}\n\n"


class GenerateEvents:
    """The SSE events of one streamed /generate: `generate_item` plus `index` per update, with each
    choice's cumulative `output_ids` kept encoded and extended by the new ids (encoding the whole list
    on every event makes a stream quadratic in its length)."""

    def __init__(self, n: int) -> None:
        self._ids = [""] * n

    def event(self, rid: str, index: int, choice: Choice, new_ids: list[int]) -> str:
        if new_ids:
            add = ",".join(map(str, new_ids))
            self._ids[index] = f"{self._ids[index]},{add}" if self._ids[index] else add
        meta = _encode({"id": rid, "prompt_tokens": choice.prompt_tokens,
                        "completion_tokens": choice.completion_tokens, "finish_reason": choice.finish_reason})
        return (f'data: {{"text":{_encode(choice.text)},"output_ids":[{self._ids[index]}],'
                f'"meta_info":{meta},"index":{index}}}\n\n')


SSE_DONE = "data: [DONE]\n\n"
