"""How schemas/base.py turns pydantic's errors into the OpenAI error shape: the `param` is the field's
path as a client wrote it, unknown keys are named whatever they are, and messages never echo a value
at length. Pure Python: no server, no model."""

from __future__ import annotations

import pytest

from appliance.server.errors import ApiError
from appliance.server.schemas.admin import PinLoRAAdapterRequest
from appliance.server.schemas.base import validate
from appliance.server.schemas.native import GenerateRequest
from appliance.server.schemas.openai import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def error(cls: type, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        validate(cls, body, "/route")
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("cls, body, param, needle", [
    (GenerateRequest, {"text": "a", "sampling_params": {"top_p": 2}}, "sampling_params.top_p", "must be <= 1"),
    (GenerateRequest, {"text": ["a", "b"], "sampling_params": [{}, {"seed": -1}]}, "sampling_params[1].seed",
     "must be >= 0"),
    (GenerateRequest, {"text": "a", "sampling_params": 3}, "sampling_params", "must be an object, got number"),
    (GenerateRequest, {"text": "a", "object": 1}, "object", "/route takes"),  # a key named like a union tag
    (GenerateRequest, {"text": "a", "sampling_params": {"<array>": 1}}, "sampling_params.<array>",
     "'sampling_params' takes"),
    (GenerateRequest, {"text": "a", "lora_path": 7}, "lora_path", "adapter name"),
    (CompletionRequest, {"prompt": "x"}, "model", "Missing required field 'model'"),
    (CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": 1.0}, "max_tokens", "an integer, got number"),
    (CompletionRequest, {"model": "m", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos", "a boolean"),
    (CompletionRequest, {"model": "m", "prompt": "x", "temperature": 10**400}, "temperature", "a number"),
    (CompletionRequest, {"model": "m", "prompt": [[1], "x"]}, "prompt", "array of arrays of token ids"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", ""),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "only text content"),
    (ChatCompletionRequest, {**CHAT, "messages": []}, "messages", "must not be empty"),
    (PinLoRAAdapterRequest, {"lora_name": "a"}, "pinned", "'pinned' must be true or false"),
])
def test_param_is_the_path(cls: type, body: dict, param: str, needle: str) -> None:
    e = error(cls, body)
    assert e.param == param and needle in e.message, (e.param, e.message)


def test_unknown_megabyte_key_comes_back_cut() -> None:
    e = error(GenerateRequest, {"text": "a", "k" * 1_000_000: 1})
    assert len(e.message) < 1000 and len(e.param or "") < 100


def test_open_models_keep_unknown_fields_by_path() -> None:
    from appliance.server.schemas.base import extra_fields

    req = validate(ChatCompletionRequest, {**CHAT, "zz": 1, "stream": True, "stream_options": {"q": 1},
                                           "messages": [{"role": "user", "content": "hi", "mood": 2}]}, "/r")
    assert sorted(extra_fields(req)) == ["messages[0].mood", "stream_options.q", "zz"]
