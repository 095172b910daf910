"""The OpenAPI 3.1 description of the HTTP API, served at GET /openapi.json, generated from the
pydantic models the routes validate with (server/schemas/): one schema validates and documents.

The paths and methods come from the app's route table (build_app passes its routes), so a route can
neither be missing from the document nor be described without existing: `build_openapi` fails on a
route that has no entry in OPERATIONS (a test builds the app, so that fails in CI, not in production).
Every error is the OpenAI error shape (errors.py). The fuzz test (tests/server/test_api_fuzz.py)
generates requests from this document, valid and invalid ones, against a live server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from appliance.config.schema import ApplianceConfig
from appliance.server.schemas import admin, native, openai, utility

_REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Op:
    summary: str
    body: Optional[type[BaseModel]] = None  # the request model
    answer: Optional[type[BaseModel]] = None  # the 200 body (None: any JSON object)
    stream: bool = False  # `stream: true` answers SSE events
    auth: Optional[str] = None  # "apiKey" | "adminKey"
    tag: str = "inference"
    media: str = "application/json"


# (method, path) -> operation. Aliases (/v1/load_lora_adapter ...) share their entry.
_LOAD = Op("Load an adapter, or reload it in place", admin.LoadLoRAAdapterRequest, admin.AdapterChange,
           auth="adminKey", tag="admin")
_UNLOAD = Op("Unload an adapter", admin.UnloadLoRAAdapterRequest, admin.AdapterUnloaded, auth="adminKey",
             tag="admin")
_PIN = Op("Pin or unpin a loaded adapter", admin.PinLoRAAdapterRequest, admin.AdapterChange, auth="adminKey",
          tag="admin")
OPERATIONS: dict[tuple[str, str], Op] = {
    ("GET", "/health"): Op("Liveness (cheap): 200 while serving, 503 while draining or when the engine "
                           "stopped", answer=utility.Status, tag="operations"),
    ("GET", "/ready"): Op("Readiness: 200 once listening with the startup adapters loaded, 503 while "
                          "starting or draining", answer=utility.Status, tag="operations"),
    ("GET", "/health_generate"): Op("Liveness through the engine: 200 only if a one-token generation "
                                    "finished within server.health_generate_timeout_s, else 503",
                                    answer=utility.Status, tag="operations"),
    ("GET", "/version"): Op("The appliance version", answer=utility.Version, tag="operations"),
    ("POST", "/tokenize"): Op("Token ids of a prompt, or of messages through the chat template (vLLM)",
                              utility.TokenizeRequest, utility.TokenizeResponse, auth="apiKey"),
    ("POST", "/detokenize"): Op("The text of token ids (vLLM)", utility.DetokenizeRequest,
                                utility.DetokenizeResponse, auth="apiKey"),
    ("GET", "/v1/models"): Op("The base model and every loaded adapter", answer=openai.ModelList, auth="apiKey"),
    ("POST", "/v1/completions"): Op("OpenAI completions", openai.CompletionRequest, openai.CompletionResponse,
                                    stream=True, auth="apiKey"),
    ("POST", "/v1/chat/completions"): Op("OpenAI chat completions (a stream: chat.completion.chunk events)",
                                         openai.ChatCompletionRequest, openai.ChatCompletionResponse,
                                         stream=True, auth="apiKey"),
    ("POST", "/generate"): Op("Native generate (SGLang-style), single or batch (a list of items)",
                              native.GenerateRequest, native.GenerateItem, stream=True, auth="apiKey"),
    ("POST", "/load_lora_adapter"): _LOAD, ("POST", "/v1/load_lora_adapter"): _LOAD,
    ("POST", "/unload_lora_adapter"): _UNLOAD, ("POST", "/v1/unload_lora_adapter"): _UNLOAD,
    ("POST", "/pin_lora_adapter"): _PIN, ("POST", "/v1/pin_lora_adapter"): _PIN,
    ("GET", "/v1/adapters"): Op("Live state of every adapter, the GPU slot pool and the CPU tier",
                                answer=admin.AdapterList, auth="adminKey", tag="admin"),
    ("GET", "/v1/status"): Op("Config generation, conditions, last reconcile", auth="adminKey", tag="admin"),
    ("GET", "/openapi.json"): Op("This document", tag="operations"),
    # Described only where the app has the route (the metrics subsystem adds it).
    ("GET", "/metrics"): Op("Prometheus metrics (text exposition format)", tag="operations", media="text/plain"),
}

_STREAMED = {openai.CompletionResponse: openai.CompletionResponse, openai.ChatCompletionResponse:
             openai.ChatCompletionChunk, native.GenerateItem: native.GenerateItem}


def _schemas() -> dict[str, Any]:
    """Every model's JSON Schema under components/schemas, nested models as shared $refs."""
    models: list[tuple[type[BaseModel], Any]] = [(utility.ErrorResponse, "serialization")]
    for op in OPERATIONS.values():
        if op.body is not None:
            models.append((op.body, "validation"))
        if op.answer is not None:
            models.append((op.answer, "serialization"))
    models += [(m, "serialization") for m in _STREAMED.values()]
    _, doc = models_json_schema(list(dict.fromkeys(models)), ref_template=_REF)
    return {**doc.get("$defs", {}), "Object": {"type": "object"}}


def _ref(model: Optional[type[BaseModel]]) -> dict[str, Any]:
    return {"$ref": _REF.format(model="Object" if model is None else model.__name__)}


def _operation(op: Op) -> dict[str, Any]:
    if op.media != "application/json":
        ok: dict[str, Any] = {op.media: {"schema": {"type": "string"}}}
    else:
        ok = {"application/json": {"schema": _ref(op.answer)}}
    if op.stream:
        item = _STREAMED[op.answer] if op.answer is not None else None
        ok["text/event-stream"] = {"schema": {"type": "string", "description": "`data: <" + (
            item.__name__ if item else "object") + " JSON>` events, then `data: [DONE]`"}}
    out: dict[str, Any] = {
        "summary": op.summary, "tags": [op.tag],
        "responses": {
            "200": {"description": "success (an SSE stream when `stream` is true)" if op.stream else "success",
                    "content": ok},
            "default": {"description": "an error, in the OpenAI error shape",
                        "content": {"application/json": {"schema": _ref(utility.ErrorResponse)}}},
        },
    }
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(op.body)}}}
    if op.auth is not None:
        out["security"] = [{op.auth: []}]
    return out


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
            paths.setdefault(r.path, {})[method.lower()] = {**_operation(op),
                                                            "operationId": _operation_id(method, r.path)}
    return {
        "openapi": "3.1.0",
        "info": {"title": "appliance", "version": _version(),
                 "description": f"Multi-LoRA LLM server serving {cfg.model.name}. Errors use the OpenAI "
                                "error shape. Limits: server.max_request_body_bytes (413), "
                                "server.max_concurrent_requests and engine.max_waiting_requests (429 with "
                                "Retry-After), server.request_timeout_s (408/504)."},
        "paths": paths,
        "components": {
            "schemas": _schemas(),
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
