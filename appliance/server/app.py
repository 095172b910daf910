"""HTTP routes: OpenAI-compatible /v1/*, the native /generate, the probes (probes.py), vLLM's utility
routes (utility.py), and the LoRA admin routes (admin.py).

Handlers parse and wire; protocol.py validates and builds the JSON, the engine does the work.
Every error leaves as the OpenAI error shape (errors.py), bad input as a 400 naming the field.

Client disconnects abort the engine requests: for streams, Starlette cancels the body iterator and
`_SSEResponse` closes it; before the first byte and for non-streaming requests, the handler races the
work against the ASGI `http.disconnect` message (`_until_disconnected`).

LoRA: a request names an adapter by OpenAI `model` (adapter name or "<base>:<adapter>") or /generate
`lora_path`; `resolve_model` checks names against the registry's published names (no engine call on the request path).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Optional, TypeVar
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, request_response
from starlette.types import Receive, Scope, Send

from appliance.config.schema import ApplianceConfig
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.engine import LLMEngine
from appliance.engine.request import (AdapterNotFoundError, EngineError, EngineStoppedError, QueueFullError,
                                      RequestError, RequestOutput)
from appliance.engine.tokenizer import Tokenizer
from appliance.lora.names import shown
from appliance.lora.registry import LoRAStateError, resolve_model_name
from appliance.lora.sources.resolver import AdapterResolver
from appliance.telemetry.metrics import BuildInfo, Metrics
from appliance.reconcile.controller import ConfigSource, Reconciler, ReconcileRecord
from appliance.server import logprob_format, protocol, samples
from appliance.server.admin import AdapterAdmin, AdminApi, adapter_card, run_on_engine
from appliance.server.auth import AdminAuth, ApiKeyAuth
from appliance.server.errors import ApiError, bad_request, error_body
from appliance.server.first_use import FirstUse
from appliance.server.group import RequestGroup
from appliance.server.limits import BodyLimits, ConcurrencyLimit, Deadline, too_many
from appliance.server.openapi import openapi_route
from appliance.server.probes import Probes
from appliance.server.state import ServerState
from appliance.server.tenants import Tenant, TenantAuth, TenantTable, Ticket
from appliance.telemetry.tenant_metrics import TenantMetrics
from appliance.server.tools.parser import ToolCallParser
from appliance.server.protocol import Choice, ParsedRequest, RequestLimits
from appliance.server.request_log import RequestLog, record_of
from appliance.server.scrape import ScrapeApi
from appliance.server.utility import UtilityApi

if TYPE_CHECKING:  # imported only when tracing.enabled (server/run.py)
    from appliance.telemetry.tracing import RequestTracer

log = logging.getLogger(__name__)

T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected before the answer; nothing to send."""


def build_app(engine: AsyncEngine, cfg: ApplianceConfig, source: Optional[ConfigSource] = None,
              metrics: Optional[Metrics] = None, tracer: Optional["RequestTracer"] = None) -> Starlette:
    """The Starlette app for a started `engine`; `app.state.server` is its `ServerState`, `app.state.metrics`
    its `Metrics` (None when metrics.enabled is false; the reconciler reports through it): `metrics`, built
    by build_metrics and fed by the engine (AsyncEngine's stats_sink). `source`: the config dir and overrides
    `cfg` was composed from, which hot reload composes again. `tracer`: the request spans (tracing.enabled;
    telemetry/tracing.py's build_tracer), None = no tracing."""
    if cfg.metrics.enabled and metrics is None:
        raise ValueError("build_app: metrics.enabled needs the engine's Metrics (build_metrics)")
    api = _Api(engine, cfg, source, tracer)
    # One limit shared by every inference route (server.max_concurrent_requests).
    limit = ConcurrencyLimit(cfg.server.max_concurrent_requests, api.body, api.admit)
    utility = UtilityApi(api.tokenizer, engine.max_model_len, api.auth, api._read_json, api.resolve_model,
                         cfg.server.strict_fields, ignored_header)
    routes = [
        *Probes(engine, api.state, cfg.server.health_generate_timeout_s).routes(),
        *utility.routes(),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/completions", limit.wrap(request_response(api.completions)), methods=["POST"]),
        Route("/v1/chat/completions", limit.wrap(request_response(api.chat_completions)), methods=["POST"]),
        Route("/generate", limit.wrap(request_response(api.generate)), methods=["POST"]),
        *api.admin.routes(),
        *(ScrapeApi(engine, metrics, api.auth, cfg.metrics.require_key).routes() if metrics else []),
    ]
    routes.append(Route("/openapi.json", openapi_route(routes, cfg), methods=["GET"]))
    reconciler = api.state.reconciler

    async def api_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, ApiError)
        e.message = reconciler.env.redact(e.message)  # values from ${oc.env:...} never leave (config/env.py)
        return e.response()

    # Inside the 500 handler, outside the others: it sees every answer, and the 500s as exceptions.
    app = Starlette(routes=routes, middleware=[Middleware(RequestLog, metrics=metrics, tracer=tracer)], exception_handlers={
        ApiError: api_error,
        HTTPException: _http_error,
        _ClientGone: _client_gone,
        Exception: _internal_error,
    })
    app.state.server = api.state
    app.state.limit = limit
    app.state.metrics = metrics
    if metrics is not None:
        api.state.reconciler.listeners.append(_reconcile_metrics(metrics, api.state.reconciler))
        api.tenants.observer = TenantMetrics(metrics.registry)
        api.tenants.observer.known(api.tenants.names)
    return app


def _reconcile_metrics(metrics: Metrics, reconciler: Reconciler) -> Callable[[ReconcileRecord], None]:
    """Feeds each finished reconcile into the reconcile and config-reload collectors."""

    def on_record(r: ReconcileRecord) -> None:
        metrics.record_reconcile(r.result, r.duration_s,
                                 [(a.action.kind, "success" if a.ok else "failed") for a in r.results])
        # Only an invalid config is a failed reload; a valid one whose actions failed was still taken.
        metrics.record_config_reload(r.result != "invalid", reconciler.generation, r.started_at)

    return on_record


def build_metrics(engine: LLMEngine, cfg: ApplianceConfig) -> Optional[Metrics]:
    """The app's collectors for `engine`, to be fed with its stats events (AsyncEngine's stats_sink:
    `record_events`); None when metrics.enabled is false."""
    if not cfg.metrics.enabled:
        return None
    from appliance import __version__

    lora = engine.lora  # its backend with auto resolved for the device
    metrics = Metrics(cfg.metrics, BuildInfo(__version__, cfg.model.name,
                                             lora.backend if lora is not None else cfg.lora.backend),
                      eviction_policy=cfg.lora.eviction_policy, lora_enabled=cfg.lora.enabled,
                      lora_slots=cfg.lora.max_loras_per_batch)
    return metrics


class _Api:
    def __init__(self, engine: AsyncEngine, cfg: ApplianceConfig, source: Optional[ConfigSource],
                 tracer: Optional["RequestTracer"] = None) -> None:
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.cfg = cfg
        self.tenants = TenantTable(cfg.tenants)  # rebuilt on every valid hot reload
        self.auth = TenantAuth(self.tenants, ApiKeyAuth(cfg.server.api_keys))
        self.body = BodyLimits(cfg.server.max_request_body_bytes, cfg.server.body_timeout_s,
                               cfg.server.request_timeout_s)
        self.limits = RequestLimits(self.tokenizer, engine.max_model_len, cfg.server.max_stop_strings,
                                    cfg.server.max_stop_chars, cfg.server.max_prompts_per_request,
                                    cfg.server.strict_fields)
        self.created = int(time.time())
        ops = AdapterAdmin(engine, managed=cfg.adapters.keys())  # loaded at start: the config's
        self.state = ServerState(Reconciler(cfg, ops, source, runtime=engine.engine.runner.runtime.view()))
        self.state.reconciler.config_listeners.append(lambda c: self.tenants.update(c.tenants))
        admin_auth = AdminAuth(cfg.server.admin_key, role_of=self._admin_role,
                               any_role=lambda: any(t.cfg.admin != "none" for t in self.tenants.tenants.values()))
        self.admin = AdminApi(ops, cfg, self._read_json, self.state.reconciler, admin_auth)
        self.first_use = FirstUse(ops, AdapterResolver(cfg.lora.resolver, cfg.lora.allowed_sources), cfg.model.name,
                                  tracer)

    def _admin_role(self, token: bytes) -> Optional[str]:
        tenant = self.tenants.identify(token)
        return None if tenant is None else tenant.cfg.admin

    # ------------------------------------------------------------------------------ plain routes
    async def models(self, request: Request) -> Response:
        tenant = self.auth.check(request)  # a tenant sees only what it may use
        base = self.cfg.model.name
        cards = [{"id": base, "object": "model", "created": self.created, "owned_by": "appliance",
                  "root": str(Path(self.cfg.model.path).expanduser()), "parent": None,
                  "max_model_len": self.engine.max_model_len}] if tenant is None or tenant.may_use(None) else []
        lora = self.engine.engine.lora
        if lora is not None:
            entries = await run_on_engine(self.engine, lora.registry.entries)
            cards += [adapter_card(e, base, self.admin.created(e.id, self.created)) for e in entries
                      if tenant is None or tenant.may_use(e.name)]
        # Any client may read this list: paths from ${oc.env:...} (the model cache, adapter roots) are
        # redacted. /v1/adapters (admin key) keeps them: `appliance plan` compares them.
        return JSONResponse(self.state.reconciler.env.redact_all({"object": "list", "data": cards}))

    def resolve_model(self, names: list[Optional[str]], param: str,
                      tenant: Optional[Tenant] = None) -> list[Optional[str]]:
        """The adapter name (None = base model) for each name a client sent as `model` or
        `lora_path`: the base model's name, an adapter name, or "<base>:<adapter>"; None = base.

        The one place that maps names to models. Unknown names answer 404 model_not_found. It reads
        the registry's published names on this thread: no engine call, so an adapter request never
        waits for a step (nor drains async scheduling's step in flight) before it is queued. The
        engine resolves the name again when it takes the request (an unload meanwhile gives a 404).
        `tenant`: only its adapters exist for it (the same 404, so names cannot be probed), and the
        base model only with allow_base (else 403).
        """
        if tenant is not None and not tenant.may_use(None) and any(
                n is None or n == self.cfg.model.name for n in names):
            raise ApiError(403, "This key may not use the base model; name one of its adapters "
                                "(GET /v1/models lists them).", param=param, code="model_not_allowed")
        base = self.cfg.model.name
        lora = self.engine.engine.lora
        if lora is None:
            asked = next((n for n in names if n is not None and n != base), None)
            if asked is not None:
                raise ApiError(404, f"The model {shown(asked)} does not exist: this server serves only "
                                    f"'{base}' (LoRA adapters are off: lora.enabled is false).",
                               param=param, code="model_not_found")
            return [None] * len(names)
        published = lora.registry.published  # one read: the whole batch sees one registry
        if tenant is not None:
            published = tenant.visible(published)
        out: list[Optional[str]] = []
        for i, n in enumerate(names):
            try:
                out.append(None if n is None else resolve_model_name(n, base, published))
            except LoRAStateError as e:
                where = param if param == "model" or len(names) == 1 else f"{param}[{i}]"
                raise ApiError(404, f"The model {shown(n)} does not exist: {e.message}", param=where,
                               code="model_not_found") from None
        return out

    # ------------------------------------------------------------------------------ OpenAI routes
    async def completions(self, request: Request) -> Response:
        deadline = Deadline(self.cfg.server.request_timeout_s)
        req, model = await self._parse(request, protocol.parse_completion)
        rid, created = f"cmpl-{record_of(request).request_id}", int(time.time())
        group = await self._start(request, req, rid, deadline)
        headers = ignored_header(req.ignored_fields, rid)
        if req.stream:
            return _SSEResponse(self._completion_stream(group, created, model, req), headers)
        sampled = await self._collect(request, group)
        choices = self._best(req, sampled)
        echo = None if req.echo is None else [req.echo_of(i, req.n) for i in range(len(choices))]
        return JSONResponse(protocol.completion_response(rid, created, model, choices, self.tokenizer, sampled,
                                                         echo), headers=headers)

    async def chat_completions(self, request: Request) -> Response:
        deadline = Deadline(self.cfg.server.request_timeout_s)
        req, model = await self._parse(request, protocol.parse_chat)
        rid, created = f"chatcmpl-{record_of(request).request_id}", int(time.time())
        group = await self._start(request, req, rid, deadline)
        headers = ignored_header(req.ignored_fields, rid)
        if req.stream:
            return _SSEResponse(self._chat_stream(group, created, model, req), headers)
        sampled = await self._collect(request, group)
        choices = self._best(req, sampled)
        return JSONResponse(protocol.chat_response(rid, created, model, choices, self.tokenizer, sampled,
                                                   req.tool_use), headers=headers)

    def _completion_stream(self, group: RequestGroup, created: int, model: str,
                           req: ParsedRequest) -> AsyncIterator[str]:
        rid, include_usage = group.request_id, req.include_usage

        def chunk(i: int, text: str, finish: Optional[str]) -> dict:
            lps = logprob_format.take(group.choices[i], self.tokenizer, "completion")
            return _with_usage(protocol.completion_chunk(rid, created, model, i, text, finish, include_usage, lps),
                               group, req)

        def usage() -> dict:
            return protocol.usage_chunk("text_completion", rid, created, model, group.choices)

        # echo: each choice opens with its prompt's text (streams have best_of == n choices per prompt).
        head = [] if req.echo is None else [
            protocol.sse(_with_usage(protocol.completion_chunk(rid, created, model, i, req.echo_of(i, req.n), None,
                                                               include_usage), group, req))
            for i in range(len(group.choices))]
        return _openai_stream(group, head, chunk, usage if include_usage else None)

    def _chat_stream(self, group: RequestGroup, created: int, model: str,
                     req: ParsedRequest) -> AsyncIterator[str]:
        rid, include_usage = group.request_id, req.include_usage
        # OpenAI opens each choice with the role (and no content yet where the answer may be only calls).
        opening = {"role": "assistant"} if req.tool_use is not None else {"role": "assistant", "content": ""}
        head = [protocol.sse(_with_usage(protocol.chat_chunk(rid, created, model, i, opening, None,
                                                             include_usage), group, req))
                for i in range(len(group.choices))]

        parsers = ([ToolCallParser(req.tool_use.forced) for _ in group.choices] if req.tool_use is not None
                   else None)

        def chunk(i: int, text: str, finish: Optional[str]) -> Optional[dict]:
            if parsers is None:
                delta = {"content": text} if text else {}
            else:  # tool calls: their deltas, and no markup in the content
                p = parsers[i]
                got = p.feed(text)
                if finish is not None:
                    end = p.finish()
                    got.content += end.content
                    got.calls += end.calls
                    finish = protocol.tool_finish_reason(finish, bool(p.calls))
                delta = protocol.tool_delta(got)
                if not delta and finish is None:
                    return None  # held back (a tag may be starting); the logprobs go with the next chunk
            lps = logprob_format.take(group.choices[i], self.tokenizer, "chat")
            return _with_usage(protocol.chat_chunk(rid, created, model, i, delta, finish, include_usage, lps),
                               group, req)

        def usage() -> dict:
            return protocol.usage_chunk("chat.completion.chunk", rid, created, model, group.choices)

        return _openai_stream(group, head, chunk, usage if include_usage else None)

    # ------------------------------------------------------------------------------ native route
    async def generate(self, request: Request) -> Response:
        """SGLang-style /generate. Streams carry cumulative `text` / `output_ids` per `index`."""
        deadline = Deadline(self.cfg.server.request_timeout_s)
        req, _ = await self._parse(request, protocol.parse_generate)
        group = await self._start(request, req, f"gen-{record_of(request).request_id}", deadline)
        if req.stream:
            return _SSEResponse(self._generate_stream(group, self.tokenizer if req.logprob_text else None))
        choices = await self._collect(request, group)
        text = self.tokenizer if req.logprob_text else None
        items = [protocol.generate_item(group.job_request_id(i), c, text) for i, c in enumerate(choices)]
        return JSONResponse(items if req.batched else items[0])

    def _generate_stream(self, group: RequestGroup, logprob_text: Optional[Tokenizer]) -> AsyncIterator[str]:
        events = protocol.GenerateEvents(len(group.choices), logprob_text)

        def item(i: int, out: RequestOutput) -> Optional[str]:
            if not (out.text or out.token_ids or out.finished):
                return None
            return events.event(group.job_request_id(i), i, group.choices[i], out.token_ids)

        return _sse_stream(group, [], item, None)

    # ------------------------------------------------------------------------------ plumbing
    def admit(self, request: Request) -> Optional[Callable[[], None]]:
        """What an inference request must pass before its body is read: its API key, no drain, and
        its tenant's concurrency and request-rate limits; returns what to call when it has ended."""
        tenant = self.auth.check(request)
        record_of(request).tenant = tenant.name if tenant is not None else None
        if self.state.draining:
            raise ApiError(503, "The server is shutting down.", code="draining")
        ticket = self.tenants.admit(tenant or self.tenants.unscoped)
        request.state.ticket = ticket  # scope["state"]: the route's handler sees it too
        return ticket.release

    async def _parse(self, request: Request,
                     parse: Callable[[dict, RequestLimits], ParsedRequest]) -> tuple[ParsedRequest, str]:
        """Parse the body and resolve its model / adapters; returns the request and the `model` to
        answer with (the base model's name, or the adapter as the client named it). `admit` ran
        before the body was read (ConcurrencyLimit)."""
        req = parse(await self._read_json(request), self.limits)
        base = self.cfg.model.name
        if req.lora_paths is not None:  # /generate: one adapter per input
            if req.model is not None and req.model != base:
                raise bad_request(f"Send the adapter either as 'model' or as 'lora_path', not both "
                                  f"('model' is {shown(req.model)}).", "lora_path")
            distinct = {n for n in req.lora_paths if n is not None and n != base}
            limit = self.cfg.server.max_adapters_per_request
            if len(distinct) > limit:
                # Each distinct adapter may need a slot and a cold read: bound what one request can ask.
                raise bad_request(f"'lora_path' names {len(distinct)} distinct adapters; at most {limit} "
                                  "are allowed in one request (server.max_adapters_per_request).", "lora_path")
            names, param = req.lora_paths, "lora_path"
        else:
            names, param = [req.model] * len(req.jobs), "model"
        ticket = _ticket(request)
        scope = ticket.tenant if ticket is not None and ticket.tenant.scoped else None
        await self.first_use.ensure(names, param, scope)  # lora.resolver: unknown adapters loaded on first use
        keys = self.resolve_model(names, param, scope)
        record_of(request).adapter = ",".join(sorted({k for k in keys if k is not None})) or None
        for job, name, key in zip(req.jobs, names, keys):
            job.adapter = name if key is not None else None
        model = req.model if req.model is not None and keys and keys[0] is not None else base
        return req, model

    async def _read_json(self, request: Request) -> dict:
        return protocol.parse_json_object(await self._read_body(request))

    async def _read_body(self, request: Request) -> bytes:
        """The body (already read by the concurrency limit on the inference routes, which replays it):
        413 past server.max_request_body_bytes, 408 past server.body_timeout_s."""
        try:
            return await self.body.read(request.receive, request.headers.get("content-length"))
        except ClientDisconnect:
            raise _ClientGone() from None

    async def _start(self, request: Request, req: ParsedRequest, rid: str, deadline: Deadline) -> RequestGroup:
        """Submit the request's jobs; return once each has its first update.

        Adapters travel by the name the client used: the engine resolves it again when it takes the
        request, so a reload in place meanwhile gives the new weights and an unload gives a 404.
        """
        jobs = req.jobs if req.best_of == 1 else samples.expand(req.jobs, req.best_of, ranked=req.best_of > req.n)
        rec = record_of(request)
        # A client's X-Request-Id may repeat; the engine's ids must not.
        tag = f"#{uuid.uuid4().hex[:12]}" if rec.client_id else ""
        ticket = _ticket(request)
        if ticket is not None:  # the tenant's max_tokens and tokens/min, on what goes to the engine
            ticket.reserve((len(j.prompt_ids), j.params.max_tokens) for j in jobs)
        group = RequestGroup(self.engine, jobs, rid, deadline, self.cfg.server.prompts_in_flight_per_request,
                             engine_tag=tag, share=ticket.tenant.share if ticket is not None else None)
        rec.choices = group.choices
        if ticket is not None:
            ticket.used = lambda: (sum(c.prompt_tokens for c in group.choices),
                                   sum(c.completion_tokens for c in group.choices))
        try:
            # Structured outputs: each distinct grammar compiled in a worker thread before anything is queued.
            for job in {j.params.grammar.key(): j for j in jobs if j.params.grammar is not None}.values():
                await _unless_disconnected(request, self.engine.compile_grammar(job.params))
            await _unless_disconnected(request, group.start())
        except EngineError as e:
            raise _to_api_error(e) from None
        rec.first_token()
        if ticket is not None:
            ticket.started()
        return group

    @staticmethod
    def _best(req: ParsedRequest, sampled: list[Choice]) -> list[Choice]:
        """The choices to answer with: all of them, or the n best of each prompt's best_of samples."""
        if req.best_of == req.n:
            return sampled
        return samples.select(sampled, req.n, req.best_of, keep_logprobs=req.jobs[0].params.logprobs is not None)

    async def _collect(self, request: Request, group: RequestGroup) -> list[Choice]:
        try:
            choices = await _unless_disconnected(request, group.collect())
        except EngineError as e:
            raise _to_api_error(e) from None
        finally:
            group.cancel()
        for c in choices:
            _raise_if_failed(c)
        return choices


def _ticket(request: Request) -> Optional[Ticket]:
    """The ticket `admit` left on the request (its tenant, or TenantTable.unscoped)."""
    return getattr(request.state, "ticket", None)


class _SSEResponse(StreamingResponse):
    """A `text/event-stream` response that always closes its body iterator.

    Closing it runs the iterator's `finally`, which cancels the engine requests: whether the stream
    ended, the client went away, or the server cancelled the handler.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                           **(headers or {})})
        self._events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


IGNORED_FIELDS_HEADER = "X-Appliance-Ignored-Fields"
_MAX_LISTED = 16  # unknown fields named in the header and the log line; the rest counted


def ignored_header(fields: list[str], rid: str) -> dict[str, str]:
    """Unknown fields were not acted on (server.strict_fields is false): one warning line and a header.
    Names are cut and percent-encoded, so a hostile key forges neither a header nor a log line."""
    if not fields:
        return {}
    names = [quote(f, safe="[]._-") for f in fields[:_MAX_LISTED]]
    more = len(fields) - len(names)
    listed = ",".join(names) + (f",+{more}" if more else "")
    log.warning("%s: ignored unknown field(s) %s (server.strict_fields=true refuses them)", rid, listed)
    return {IGNORED_FIELDS_HEADER: listed}


def _with_usage(chunk: dict, group: RequestGroup, req: ParsedRequest) -> dict:
    """stream_options.continuous_usage_stats (vLLM): every chunk carries the usage so far."""
    if req.continuous_usage:
        chunk["usage"] = protocol.usage(group.choices)
    return chunk


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise _ClientGone.

    Call only after the body has been read: from then on the ASGI receive channel yields nothing but
    `http.disconnect`.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        raise _ClientGone()
    return task.result()


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _openai_stream(group: RequestGroup, head: list[str],
                   chunk: Callable[[int, str, Optional[str]], Optional[dict]],
                   usage: Optional[Callable[[], dict]]) -> AsyncIterator[str]:
    """An OpenAI stream: a chunk per update that carries text or a finish (see _sse_stream); `chunk`
    returns None for an update with nothing to send yet."""
    def event(i: int, out: RequestOutput) -> Optional[str]:
        if not (out.text or out.finished):
            return None
        c = chunk(i, out.text, group.choices[i].finish_reason)
        return None if c is None else protocol.sse(c)

    return _sse_stream(group, head, event, usage)


async def _sse_stream(group: RequestGroup, head: list[str], event: Callable[[int, RequestOutput], Optional[str]],
                      usage: Optional[Callable[[], dict]]) -> AsyncIterator[str]:
    """The SSE events of one stream: `head`, the event of each update (None = nothing to send), the
    usage chunk when asked, then [DONE]. An error mid-stream becomes an error event before [DONE] (a
    bug of ours too: logged, then the 500 a non-streamed request gets, instead of a cut connection);
    the request is cancelled however the stream ends (client gone included)."""
    try:
        for ev in head:
            yield ev
        async for i, out in group.updates():
            _raise_if_failed(group.choices[i])
            ev = event(i, out)
            if ev is not None:
                yield ev
        if usage is not None:
            yield protocol.sse(usage())
        yield protocol.SSE_DONE
    except (ApiError, EngineError) as e:
        yield _to_api_error(e).sse_event()
        yield protocol.SSE_DONE
    except Exception as e:  # noqa: BLE001 - the status went out already; the client still hears why
        log.exception("stream %s failed after its 200", group.request_id)
        yield protocol.sse(error_body(500, f"Internal server error: {type(e).__name__}"))
        yield protocol.SSE_DONE
    finally:
        group.cancel()


def _raise_if_failed(choice: Choice) -> None:
    if choice.finish_reason == "error":
        raise ApiError(500, f"The engine failed on this request: {choice.error}", code="engine_error")
    if choice.finish_reason == "abort":
        raise ApiError(503, "The engine aborted this request.", code="aborted")


def _to_api_error(e: ApiError | EngineError) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, AdapterNotFoundError):
        return ApiError(404, str(e), param="model", code="model_not_found")
    if isinstance(e, RequestError):
        return bad_request(str(e), e.param)
    if isinstance(e, QueueFullError):
        return too_many(f"The server is busy: {e}; retry later.", "queue_full")
    if isinstance(e, EngineStoppedError):
        return ApiError(503, str(e), code="engine_stopped")
    return ApiError(500, f"{type(e).__name__}: {e}", code="engine_error")


# ---------------------------------------------------------------------------------- exception handlers

async def _http_error(request: Request, e: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (wrong method), in the OpenAI shape."""
    assert isinstance(e, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    if e.status_code == 404:
        message = f"No route {request.method} {request.url.path}."
    elif e.status_code == 405:
        allow = (e.headers or {}).get("Allow", "")
        message = f"Method {request.method} is not allowed on {request.url.path} (allowed: {allow})."
    else:
        message = str(e.detail)
    return ApiError(e.status_code, message, code=code, headers=e.headers).response()


async def _client_gone(request: Request, e: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


async def _internal_error(request: Request, e: Exception) -> Response:
    # Starlette re-raises after this, so uvicorn logs the traceback too.
    return JSONResponse(error_body(500, f"Internal server error: {type(e).__name__}"), status_code=500)
