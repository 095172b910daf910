"""The record of one HTTP request: its id (X-Request-Id), the route it took, what it ran and how it
ended; one log line and one `appliance_http_requests_total` count when it is answered.

`RequestLog` is a pure ASGI middleware around every route. A client's `X-Request-Id` is kept when it is
1..128 characters of [A-Za-z0-9._:-] (safe in a header, a log line and an OpenAI `id`); anything else
is replaced by a fresh uuid4 hex, and the id in use is echoed in the response's `X-Request-Id`. The
handlers fill the record's adapter, tokens and TTFT (`record_of`); the line is written when the last
body byte is sent (a stream: after [DONE]) or the request fails, whichever comes first, exactly once.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional
from urllib.parse import quote

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.server.protocol import Choice, usage
from appliance.telemetry.metrics import Metrics

if TYPE_CHECKING:  # imported only when tracing.enabled (server/run.py)
    from appliance.telemetry.tracing import RequestSpan, RequestTracer

REQUEST_ID_HEADER = "X-Request-Id"
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_SCOPE_KEY = "appliance.request"
UNMATCHED = "unmatched"  # the route label of a path no route serves (404): never the raw path

log = logging.getLogger("appliance.request")


def request_id_from(header: Optional[str]) -> str:
    """The client's id when it is safe to echo, log and put in an OpenAI `id`; else a fresh one."""
    if header is not None and _VALID_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


@dataclass
class RequestRecord:
    request_id: str
    client_id: bool  # True: the client chose request_id, so it may repeat (engine ids add a tag)
    started: float = field(default_factory=time.monotonic)
    adapter: Optional[str] = None  # registered adapter name(s), comma-separated; None = base model
    tenant: Optional[str] = None  # the configured tenant whose key it came with (tenants.*)
    choices: Optional[list[Choice]] = None  # the request's choices, filled in as it runs
    ttft_s: Optional[float] = None  # arrival to the first token of every prompt of the first window

    def first_token(self) -> None:
        self.ttft_s = time.monotonic() - self.started


def record_of(request: Request) -> RequestRecord:
    """The record RequestLog opened for this request."""
    return request.scope[_SCOPE_KEY]


class RequestLog:
    def __init__(self, app: ASGIApp, metrics: Optional[Metrics] = None,
                 tracer: Optional["RequestTracer"] = None) -> None:
        self.app = app
        self.metrics = metrics
        self.tracer = tracer  # tracing.enabled: a span per request, ended with the log line

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        rec = RequestRecord(request_id_from(header), client_id=header is not None and header == request_id_from(header))
        scope[_SCOPE_KEY] = rec
        status: list[int] = []
        done = False
        span: Optional[RequestSpan] = None
        token = None
        if self.tracer is not None and self.tracer.traces(scope["path"]):
            span = self.tracer.start(scope["method"], scope["headers"], rec.started)
            token = span.attach()

        async def send_traced(message: Message) -> None:
            nonlocal done
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message["headers"] = [*message.get("headers", []),
                                      (REQUEST_ID_HEADER.lower().encode(), rec.request_id.encode())]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self._finish(scope, rec, status[0] if status else 500, span)

        try:
            await self.app(scope, receive, send_traced)
        except BaseException:
            if not done:
                done = True
                # Not answered yet: the error handler outside answers 500; answered: the stream broke.
                self._finish(scope, rec, status[0] if status else 500, span)
            raise
        finally:
            if token is not None:
                span.detach(token)  # type: ignore[union-attr]
        if not done:  # no body was sent (the client left mid-stream)
            done = True
            self._finish(scope, rec, status[0] if status else 499, span)

    def _finish(self, scope: Scope, rec: RequestRecord, code: int, span: Optional["RequestSpan"] = None) -> None:
        route_obj = scope.get("route")
        route = getattr(route_obj, "path", None) or UNMATCHED
        if self.metrics is not None:
            self.metrics.record_http(route, code)
        u = usage(rec.choices) if rec.choices is not None else {}
        fields = {
            "request_id": rec.request_id, "method": scope["method"], "route": route,
            "path": quote(scope["path"], safe="/._-~"), "status": code, "adapter": rec.adapter,
            "tenant": rec.tenant,
            "prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
            "ttft_s": None if rec.ttft_s is None else round(rec.ttft_s, 6),
            "e2e_s": round(time.monotonic() - rec.started, 6),
        }
        log.info("%s %s %s %d adapter=%s prompt_tokens=%s completion_tokens=%s ttft_s=%s e2e_s=%s",
                 rec.request_id, fields["method"], route, code, rec.adapter, fields["prompt_tokens"],
                 fields["completion_tokens"], fields["ttft_s"], fields["e2e_s"], extra=fields)
        if span is not None:
            span.end(None if route == UNMATCHED else route, code,
                     {"url.path": fields["path"], "appliance.request_id": rec.request_id,
                      "appliance.adapter": rec.adapter, "appliance.tenant": rec.tenant,
                      "gen_ai.usage.input_tokens": fields["prompt_tokens"],
                      "gen_ai.usage.output_tokens": fields["completion_tokens"]},
                     [c.last for c in rec.choices or ()])
