"""OpenTelemetry traces of HTTP requests (`tracing.*`, docs/tracing.md).

`RequestTracer`, built only when tracing.enabled, opens a server span when a request arrives (joined
to the caller's trace when it sends a W3C `traceparent`) and makes it current while the route runs, so
a span started on the way (a first-use adapter load) nests under it. When the answer has been sent
(server/request_log.py) the span gets its route, status and request attributes, and each engine
request behind it gets the spans of its phases, built from the timestamps the engine keeps anyway
(`RequestOutput`): queue (arrival -> first scheduled), prefill (-> first token), decode (-> finish),
and adapter_load (it waited for its adapter's weights: inside queue with lora.overlap_loading, inside
prefill without). The engine thread does no tracing work. With tracing off this module is not even
imported; spans leave through the SDK's BatchSpanProcessor (its own thread) as OTLP over HTTP.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from appliance.config.schema import ConfigError, TracingConfig
from appliance.engine.request import RequestOutput

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

# Probes and scrapes: a span every few seconds per replica that says nothing about a request.
UNTRACED_PATHS = frozenset({"/health", "/ready", "/metrics"})
EXTRA_HINT = "pip install 'appliance[tracing]'"


def build_tracer(cfg: TracingConfig, exporter: Optional["SpanExporter"] = None) -> "RequestTracer":
    """The tracer for `cfg` (tracing.enabled), exporting to cfg.otlp_endpoint, or to `exporter` when
    given (tests: the SDK's InMemorySpanExporter). ConfigError naming the extra when the OpenTelemetry
    packages are not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as e:
        raise ConfigError(f"tracing.enabled: the OpenTelemetry packages are not installed ({e.name} is "
                          f"missing); install the tracing extra: {EXTRA_HINT}, or set tracing.enabled=false") from None
    from appliance import __version__

    if exporter is None:
        exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, headers=dict(cfg.headers),
                                    timeout=cfg.export_timeout_s)
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name,
                                                        "service.version": __version__}),
                              sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
                              shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return RequestTracer(provider, TraceContextTextMapPropagator())


class RequestTracer:
    """Spans for the HTTP requests of one server; its own TracerProvider (the global one is left alone)."""

    def __init__(self, provider: "TracerProvider", propagator: Any) -> None:
        self.provider = provider
        self.tracer: "Tracer" = provider.get_tracer("appliance")
        self._propagator = propagator

    @staticmethod
    def traces(path: str) -> bool:
        return path not in UNTRACED_PATHS

    def start(self, method: str, headers: Sequence[tuple[bytes, bytes]], started: float) -> "RequestSpan":
        """The server span of a request that arrived at `started` (time.monotonic()), child of the
        caller's span when its headers carry a valid `traceparent`."""
        from opentelemetry.trace import SpanKind

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
                   if k in (b"traceparent", b"tracestate")}
        clock = _Clock()
        span = self.tracer.start_span(method, context=self._propagator.extract(carrier), kind=SpanKind.SERVER,
                                      start_time=clock.ns(started), attributes={"http.request.method": method})
        return RequestSpan(self, span, clock)

    def span(self, name: str, attributes: Mapping[str, Any]) -> AbstractContextManager:
        """A span around work done now, a child of the current one (the request's server span)."""
        return self.tracer.start_as_current_span(name, attributes=dict(attributes))

    def shutdown(self) -> None:
        """Export what is buffered, then stop (server shutdown)."""
        self.provider.shutdown()


class _Clock:
    """time.monotonic() seconds -> epoch nanoseconds, with one offset for all of a request's spans
    (their order is the engine's, whatever the wall clock does meanwhile)."""

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, t: float) -> int:
        return self.offset_ns + int(t * 1e9)


class RequestSpan:
    def __init__(self, tracer: RequestTracer, span: "Span", clock: _Clock) -> None:
        self._tracer = tracer
        self.span = span
        self._clock = clock

    def attach(self) -> object:
        """Make the span current (the route's work nests under it); hand the token to `detach`."""
        from opentelemetry import context, trace

        return context.attach(trace.set_span_in_context(self.span))

    @staticmethod
    def detach(token: object) -> None:
        from opentelemetry import context

        context.detach(token)  # type: ignore[arg-type]

    def end(self, route: Optional[str], code: int, attributes: Mapping[str, Any],
            outputs: Sequence[Optional[RequestOutput]]) -> None:
        """Close the server span (route None: no route matched) after adding the spans of each engine
        request's phases (`outputs`: each one's final update; None = it did not finish)."""
        from opentelemetry.trace import Status, StatusCode

        span, now = self.span, time.monotonic()
        if not span.is_recording():  # not sampled: nothing is kept, so nothing to build
            span.end()
            return
        if route is not None:
            span.update_name(f"{span.name} {route}")  # type: ignore[attr-defined]
            span.set_attribute("http.route", route)
        span.set_attribute("http.response.status_code", code)
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if code >= 500:
            span.set_status(Status(StatusCode.ERROR))
        for i, out in enumerate(outputs):
            if out is not None:
                self._phases(i, out)
        span.end(end_time=self._clock.ns(now))

    def _phases(self, index: int, out: RequestOutput) -> None:
        from opentelemetry import trace

        base = {"appliance.engine_request_id": out.request_id, "appliance.job_index": index}
        parent = trace.set_span_in_context(self.span)
        queue = self._child("queue", parent, out.arrival_time, out.first_scheduled_time, base)
        prefill = self._child("prefill", parent, out.first_scheduled_time, out.first_token_time,
                              {**base, "gen_ai.usage.input_tokens": out.prompt_tokens})
        self._child("decode", parent, out.first_token_time, out.finish_time,
                    {**base, "gen_ai.usage.output_tokens": out.completion_tokens,
                     "appliance.finish_reason": out.finish_reason or ""},
                    error=(out.error or "engine error") if out.finish_reason == "error" else None)
        if out.load_wait_start is not None:
            # Waited before it was scheduled (a background read): inside queue; else its step's slot fill.
            inside = queue if (out.first_scheduled_time is None
                               or out.load_wait_start < out.first_scheduled_time) else prefill
            end = out.load_wait_end if out.load_wait_end is not None else out.first_scheduled_time
            ctx = parent if inside is None else trace.set_span_in_context(inside)
            self._child("adapter_load", ctx, out.load_wait_start, end, base)

    def _child(self, name: str, ctx: Any, start: Optional[float], end: Optional[float],
               attributes: Mapping[str, Any], error: Optional[str] = None) -> Optional["Span"]:
        if start is None or end is None:
            return None  # that phase never began (aborted while queued, failed before a token)
        s = self._tracer.tracer.start_span(name, context=ctx, start_time=self._clock.ns(start),
                                           attributes=dict(attributes))
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            s.set_status(Status(StatusCode.ERROR, error))
        # Ended at once, with its recorded end: a child ended before its parent is fine in OTLP.
        s.end(end_time=self._clock.ns(max(end, start)))
        return s
