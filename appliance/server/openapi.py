"""The OpenAPI 3.0 description of the HTTP API, served at GET /openapi.json.

The paths and methods come from the app's route table (build_app passes its routes), so a route can
neither be missing from the document nor be described without existing: `build_openapi` fails on a
route that has no entry in OPERATIONS (a test builds the app, so that fails in CI, not in production).
The request bodies are described as the parsers in protocol.py and admin.py accept them; every error
is the OpenAI error shape (errors.py). The fuzz test (tests/server/test_api_fuzz.py) generates requests
from this document, valid and invalid ones, against a live server.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from appliance.config.schema import ApplianceConfig

_NULL_INT = {"type": "integer", "nullable": True}
_NULL_NUM = {"type": "number", "nullable": True}
_NULL_BOOL = {"type": "boolean", "nullable": True}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STOP = {"nullable": True, "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

# Sampling fields shared by the OpenAI routes (protocol._sampling); null = absent.
_SAMPLING = {
    "temperature": {**_NULL_NUM, "minimum": 0}, "top_p": {**_NULL_NUM, "minimum": 0, "maximum": 1},
    "top_k": {**_NULL_INT, "minimum": -1}, "seed": {**_NULL_INT, "minimum": 0},
    "min_tokens": {**_NULL_INT, "minimum": 0}, "ignore_eos": _NULL_BOOL, "stop": _STOP,
    "stop_token_ids": {**_TOKEN_IDS, "nullable": True}, "n": {**_NULL_INT, "minimum": 1},
    "presence_penalty": {**_NULL_NUM, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NULL_NUM, "minimum": -2, "maximum": 2},
    "repetition_penalty": {**_NULL_NUM, "minimum": 0, "exclusiveMinimum": True}, "min_p": {**_NULL_NUM, "minimum": 0, "maximum": 1},
    "logit_bias": {"type": "object", "nullable": True, "maxProperties": 300,
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "user": {"type": "string", "nullable": True}, "stream": _NULL_BOOL,
    "stream_options": {"type": "object", "nullable": True,
                       "properties": {"include_usage": _NULL_BOOL}},
}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": "string", "nullable": True},
                           "code": {"type": "string", "nullable": True}}}},
    },
    "CompletionRequest": {
        "type": "object", "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string", "description": "the base model's name, an adapter's name, or "
                                                       "<base>:<adapter>"},
            "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                                 {**_TOKEN_IDS, "minItems": 1},
                                 {"type": "array", "minItems": 1, "items": {**_TOKEN_IDS, "minItems": 1}}]},
            "max_tokens": {**_NULL_INT, "minimum": 1},
            "logprobs": {**_NULL_INT, "minimum": 0, "maximum": 20}, "best_of": {**_NULL_INT, "minimum": 1},
            **_SAMPLING,
        },
    },
    "ChatCompletionRequest": {
        "type": "object", "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
                    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                        "type": "object", "required": ["type", "text"],
                        "properties": {"type": {"type": "string", "enum": ["text"]},
                                       "text": {"type": "string"}}}}]},
                    "name": {"type": "string", "nullable": True}}}},
            "max_tokens": {**_NULL_INT, "minimum": 1},
            "max_completion_tokens": {**_NULL_INT, "minimum": 1},
            "logprobs": _NULL_BOOL, "top_logprobs": {**_NULL_INT, "minimum": 0, "maximum": 20},
            **_SAMPLING,
        },
    },
    "GenerateRequest": {
        "type": "object", "additionalProperties": False,
        "description": "exactly one of text and input_ids",
        "properties": {
            "text": {"oneOf": [{"type": "string", "minLength": 1},
                               {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}]},
            "input_ids": {"oneOf": [{**_TOKEN_IDS, "minItems": 1},
                                    {"type": "array", "minItems": 1, "items": {**_TOKEN_IDS, "minItems": 1}}]},
            "sampling_params": {"type": "object", "nullable": True, "additionalProperties": False,
                                "properties": {"max_new_tokens": {**_NULL_INT, "minimum": 1},
                                               "min_new_tokens": {**_NULL_INT, "minimum": 0},
                                               **{k: _SAMPLING[k] for k in ("temperature", "top_p", "top_k",
                                                                            "seed", "ignore_eos", "stop",
                                                                            "stop_token_ids", "presence_penalty",
                                                                            "frequency_penalty", "repetition_penalty",
                                                                            "min_p", "logit_bias")}}},
            "stream": _NULL_BOOL,
            "return_logprob": _NULL_BOOL, "top_logprobs_num": {**_NULL_INT, "minimum": 0, "maximum": 20},
            "return_text_in_logprobs": _NULL_BOOL,
            "model": {"type": "string", "nullable": True},
            "lora_path": {"nullable": True, "oneOf": [
                {"type": "string"}, {"type": "array", "items": {"type": "string", "nullable": True}}]},
        },
    },
    "LoadAdapterRequest": {
        "type": "object", "additionalProperties": False, "required": ["lora_name", "lora_path"],
        "properties": {"lora_name": {"type": "string", "minLength": 1},
                       "lora_path": {"type": "string", "minLength": 1},
                       "pinned": _NULL_BOOL, "load_inplace": _NULL_BOOL},
    },
    "UnloadAdapterRequest": {
        "type": "object", "additionalProperties": False, "required": ["lora_name"],
        "properties": {"lora_name": {"type": "string", "minLength": 1}},
    },
    "PinAdapterRequest": {
        "type": "object", "additionalProperties": False, "required": ["lora_name", "pinned"],
        "properties": {"lora_name": {"type": "string", "minLength": 1}, "pinned": {"type": "boolean"}},
    },
    "Object": {"type": "object"},
}

_JSON_OR_SSE = {"application/json": {"schema": {"$ref": "#/components/schemas/Object"}},
                "text/event-stream": {"schema": {"type": "string"}}}


def _op(summary: str, body: Optional[str] = None, stream: bool = False, auth: Optional[str] = None,
        tag: str = "inference") -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary, "tags": [tag],
        "responses": {
            "200": {"description": "success (an SSE stream when `stream` is true)" if stream else "success",
                    "content": _JSON_OR_SSE if stream else
                    {"application/json": {"schema": {"$ref": "#/components/schemas/Object"}}}},
            "default": {"description": "an error, in the OpenAI error shape",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
        },
    }
    if body is not None:
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}}
    if auth is not None:
        op["security"] = [{auth: []}]
    return op


# (method, path) -> operation. Aliases (/v1/load_lora_adapter ...) share their entry.
_LOAD = _op("Load an adapter, or reload it in place", "LoadAdapterRequest", auth="adminKey", tag="admin")
_UNLOAD = _op("Unload an adapter", "UnloadAdapterRequest", auth="adminKey", tag="admin")
_PIN = _op("Pin or unpin a loaded adapter", "PinAdapterRequest", auth="adminKey", tag="admin")
OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("GET", "/health"): _op("Liveness: 200 while serving, 503 while draining or when the engine stopped",
                            tag="operations"),
    ("GET", "/v1/models"): _op("The base model and every loaded adapter", auth="apiKey"),
    ("POST", "/v1/completions"): _op("OpenAI completions", "CompletionRequest", stream=True, auth="apiKey"),
    ("POST", "/v1/chat/completions"): _op("OpenAI chat completions", "ChatCompletionRequest", stream=True,
                                          auth="apiKey"),
    ("POST", "/generate"): _op("Native generate (SGLang-style), single or batch", "GenerateRequest",
                               stream=True, auth="apiKey"),
    ("POST", "/load_lora_adapter"): _LOAD, ("POST", "/v1/load_lora_adapter"): _LOAD,
    ("POST", "/unload_lora_adapter"): _UNLOAD, ("POST", "/v1/unload_lora_adapter"): _UNLOAD,
    ("POST", "/pin_lora_adapter"): _PIN, ("POST", "/v1/pin_lora_adapter"): _PIN,
    ("GET", "/v1/adapters"): _op("Live state of every adapter, the GPU slot pool and the CPU tier",
                                 auth="adminKey", tag="admin"),
    ("GET", "/v1/status"): _op("Config generation, conditions, last reconcile", auth="adminKey", tag="admin"),
    ("GET", "/openapi.json"): _op("This document", tag="operations"),
    # Described only where the app has the route (the metrics subsystem adds it).
    ("GET", "/metrics"): {"summary": "Prometheus metrics (text exposition format)", "tags": ["operations"],
                          "responses": {"200": {"description": "metrics",
                                                "content": {"text/plain": {"schema": {"type": "string"}}}}}},
}


def build_openapi(routes: Sequence[BaseRoute], cfg: ApplianceConfig) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        if not isinstance(r, Route):
            continue
        for method in sorted(r.methods or ()):
            if method == "HEAD":
                continue
            op = OPERATIONS.get((method, r.path))
            if op is None:
                raise KeyError(f"route {method} {r.path} has no entry in appliance/server/openapi.py "
                               "OPERATIONS: describe it there")
            paths.setdefault(r.path, {})[method.lower()] = {**op, "operationId": _operation_id(method, r.path)}
    return {
        "openapi": "3.0.3",
        "info": {"title": "appliance", "version": _version(),
                 "description": f"Multi-LoRA LLM server serving {cfg.model.name}. Errors use the OpenAI "
                                "error shape. Limits: server.max_request_body_bytes (413), "
                                "server.max_concurrent_requests and engine.max_waiting_requests (429 with "
                                "Retry-After), server.request_timeout_s (408/504)."},
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer",
                           "description": "one of server.api_keys (not needed when that list is empty)"},
                "adminKey": {"type": "http", "scheme": "bearer", "description": "server.admin_key"}},
        },
    }


def openapi_route(routes: Sequence[BaseRoute], cfg: ApplianceConfig) -> Callable[[Request], Any]:
    """The GET /openapi.json handler; the document is built now, so a route without a description
    fails at startup. Built once: the route table never changes while the app runs."""
    doc = build_openapi([*routes, Route("/openapi.json", _placeholder, methods=["GET"])], cfg)

    async def openapi(request: Request) -> Response:
        return JSONResponse(doc)

    return openapi


async def _placeholder(request: Request) -> Response:  # stands for the route being built
    raise NotImplementedError


def _operation_id(method: str, path: str) -> str:
    return method.lower() + path.replace("/", "_").replace(".", "_")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("appliance")
    except PackageNotFoundError:
        return "0"
