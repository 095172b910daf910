"""OpenTelemetry tracing on a real server: the request path's spans reach the SDK's in-memory exporter
(the one thing the test swaps for the OTLP exporter), joined to the caller's `traceparent`, nested
under the server span, with their attributes, queue/prefill/decode in order and without overlap, and
adapter_load where the request waited for its adapter's weights; tracing off creates none; the config
errors."""

from __future__ import annotations

import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Iterator

import openai
import pytest
import requests
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from appliance.config.schema import ConfigError
from appliance.telemetry.tracing import RequestTracer, build_tracer
from appliance.config.compose import compose_config
from tests.conftest import REPO, config_tree, default_config
from tests.lora.sources.conftest import BUCKET, s3, s3_url, upload  # noqa: F401 - fixtures: a real S3 API server
from tests.server.conftest import ServerThread, start_server
from tests.telemetry.helpers import ADMIN, ADMIN_KEY, MODEL, make_adapters

LORA = ("model.name=tiny", "model.max_model_len=512", "model.device=cpu", "engine.num_kv_blocks=256",
        "lora.enabled=true", "lora.max_lora_rank=8", "lora.max_loras_per_batch=2",
        f"server.admin_key={ADMIN_KEY}", "server.host=127.0.0.1", "server.port=0", "tracing.enabled=true")


class Traced:
    def __init__(self, *overrides: str) -> None:
        self.exporter = InMemorySpanExporter()
        cfg = default_config(*LORA, *overrides)
        self.tracer = build_tracer(cfg.tracing, self.exporter)  # the OTLP exporter's place, nothing else
        self.srv = ServerThread(cfg, tracer=self.tracer).start()

    def spans(self, trace_id: int) -> list[ReadableSpan]:
        return finished(self.tracer, self.exporter, trace_id)

    def recorded(self, trace_id: int) -> list[ReadableSpan]:
        """The spans of `trace_id` ended so far, without waiting for a server span: after settled(), a
        trace that must have none (spans() would wait out its deadline for one)."""
        return ended(self.tracer, self.exporter, trace_id)

    def settled(self) -> None:
        """Returns once the spans of every request answered so far have ended: a traced request sent
        after them has its own."""
        trace_id, _, headers = caller()
        assert requests.get(self.srv.url + "/v1/models", headers=headers, timeout=30).status_code == 200
        assert self.spans(trace_id)

    def load(self, name: str, path: Path) -> None:
        r = requests.post(self.srv.url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                          json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("traced_adapters")
    return {**make_adapters(root, tiny_model_dir), "root": root}


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, adapters: dict[str, Path]) -> Iterator[Traced]:
    t = Traced(f"model.path={tiny_model_dir}", f"lora.adapter_roots=[{adapters['root']}]")
    yield t
    t.srv.stop()


def finished(tracer: RequestTracer, exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    """The spans of `trace_id` once its server span has ended. It ends with the request's log line,
    just after the last byte went out, so a client may read its answer a moment before."""
    deadline = time.monotonic() + 30
    while True:
        spans = ended(tracer, exporter, trace_id)
        if any(s.kind is SpanKind.SERVER for s in spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def ended(tracer: RequestTracer, exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    tracer.provider.force_flush()
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def caller() -> tuple[int, int, dict[str, str]]:
    """A caller's trace and span ids and the W3C header that carries them (sampled)."""
    trace_id, span_id = int(secrets.token_hex(16), 16), int(secrets.token_hex(8), 16)
    return trace_id, span_id, {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}


def by_name(spans: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def check_request(spans: list[ReadableSpan], caller_span: int, route: str, request_id: str,
                  completion_tokens: int) -> dict[str, list[ReadableSpan]]:
    named = by_name(spans)
    (server,) = named[f"POST {route}"]
    assert server.kind is SpanKind.SERVER and server.parent is not None
    assert server.parent.span_id == caller_span and server.parent.is_remote
    attrs = server.attributes
    assert attrs["http.route"] == route and attrs["http.request.method"] == "POST"
    assert attrs["http.response.status_code"] == 200 and attrs["appliance.request_id"] == request_id
    assert attrs["appliance.adapter"] == "qv4" and "appliance.tenant" not in attrs  # no tenants configured
    assert attrs["gen_ai.usage.output_tokens"] == completion_tokens
    (queue,), (prefill,), (decode,) = named["queue"], named["prefill"], named["decode"]
    for s in (queue, prefill, decode):
        assert s.parent is not None and s.parent.span_id == server.context.span_id
        assert request_id in s.attributes["appliance.engine_request_id"]  # e.g. chatcmpl-plain-1#<tag>
    # Ordered, touching, not overlapping, inside the server span.
    assert server.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.start_time <= prefill.end_time == decode.start_time <= decode.end_time <= server.end_time
    assert decode.attributes["gen_ai.usage.output_tokens"] == completion_tokens
    assert decode.attributes["appliance.finish_reason"] == "length"
    assert prefill.attributes["gen_ai.usage.input_tokens"] == attrs["gen_ai.usage.input_tokens"] > 0
    return named


def test_streamed_and_plain_requests_join_the_callers_trace(traced: Traced, adapters: dict[str, Path]) -> None:
    traced.load("qv4", adapters["qv4"])
    client = openai.OpenAI(base_url=traced.srv.url + "/v1", api_key="unused", max_retries=0)

    trace_id, span_id, headers = caller()
    raw = client.chat.completions.with_raw_response.create(
        model="qv4", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True}, extra_headers={**headers, "X-Request-Id": "plain-1"})
    answer = raw.parse()
    named = check_request(traced.spans(trace_id), span_id, "/v1/chat/completions", "plain-1",
                          answer.usage.completion_tokens)
    # The adapter's first request after the admin load: its step read the weights into a GPU slot
    # (lora.overlap_loading off), so the wait is an adapter_load span inside prefill.
    (load,) = named["adapter_load"]
    (prefill,) = named["prefill"]
    assert load.parent is not None and load.parent.span_id == prefill.context.span_id
    assert prefill.start_time <= load.start_time <= load.end_time <= prefill.end_time

    trace_id, span_id, headers = caller()
    stream = client.completions.create(model="qv4", prompt="Once upon a time", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True},
                                       extra_headers={**headers, "X-Request-Id": "stream-1"})
    chunks = list(stream)
    named = check_request(traced.spans(trace_id), span_id, "/v1/completions", "stream-1", chunks[-1].usage.completion_tokens)
    assert "adapter_load" not in named  # the adapter is in its slot now: nothing was waited for


def test_overlap_loading_wait_is_inside_queue(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    t = Traced(f"model.path={tiny_model_dir}", f"lora.adapter_roots=[{adapters['root']}]",
               "lora.overlap_loading=true", "lora.max_loaded_loras=2", "debug.fault_injection_read_delay_s=0.5")
    try:
        for name in ("qv4", "mlp6", "down2"):  # a CPU tier of 2: qv4's weights are on disk only now
            t.load(name, adapters[name])
        trace_id, span_id, headers = caller()
        r = requests.post(t.srv.url + "/generate", headers=headers, timeout=120,
                          json={"text": "Hi", "lora_path": "qv4",
                                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        named = by_name(t.spans(trace_id))
        (queue,), (load,) = named["queue"], named["adapter_load"]
        assert load.parent is not None and load.parent.span_id == queue.context.span_id
        assert queue.start_time <= load.start_time < load.end_time <= queue.end_time
        assert load.end_time - load.start_time >= 0.5e9  # the injected read delay
    finally:
        t.srv.stop()


def test_first_use_load_is_a_span_under_the_request(tmp_path: Path, tiny_model_dir: Path,
                                                    adapters: dict[str, Path], s3, s3_url: str) -> None:
    upload(s3, adapters["qv4"], "traced/lazy")
    cfg = compose_config(config_tree(tmp_path / "configs", "adapters: {}\n"), [
        *LORA, f"model.path={tiny_model_dir}", "lora.max_loaded_loras=2", f"lora.allowed_sources=[s3://{BUCKET}/traced]",
        f"lora.s3_endpoint_url={s3_url}", "lora.s3_region=us-east-1", f"lora.adapter_cache_dir={tmp_path / 'cache'}",
        f"lora.resolver.sources=['s3://{BUCKET}/traced/{{name}}']", "reconcile.watch=false"])
    exporter = InMemorySpanExporter()
    tracer = build_tracer(cfg.tracing, exporter)
    srv = ServerThread(cfg, tracer=tracer).start()
    try:
        trace_id, span_id, headers = caller()
        r = requests.post(srv.url + "/v1/completions", headers=headers, timeout=120,
                          json={"model": "lazy", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        named = by_name(finished(tracer, exporter, trace_id))
        (server,), (prefill,) = named["POST /v1/completions"], named["prefill"]
        # The resolver's fetch and load, then the slot fill of the step that admitted the request.
        (load,) = [s for s in named["adapter_load"] if s.parent is not None and s.parent.span_id == server.context.span_id]
        (fill,) = [s for s in named["adapter_load"] if s.parent is not None and s.parent.span_id == prefill.context.span_id]
        assert load.attributes["appliance.adapter"] == "lazy" and "appliance.adapter_source" not in fill.attributes
        assert load.attributes["appliance.adapter_source"] == "resolver"
        assert server.start_time <= load.start_time <= load.end_time <= named["queue"][0].start_time
    finally:
        srv.stop()


class Collector:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: decodes each export as a collector would (the
    protobuf messages of opentelemetry-proto) and keeps its spans and headers."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        got = self.requests = []  # (path, headers, ExportTraceServiceRequest)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                got.append((self.path, dict(self.headers), ExportTraceServiceRequest.FromString(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list:
        return [s for _, _, req in self.requests for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def test_spans_reach_an_otlp_http_collector(tmp_path: Path, tiny_model_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The production exporter, end to end: the configured endpoint, headers and service name."""
    collector = Collector()
    monkeypatch.setenv("APPLIANCE_TEST_OTLP_TOKEN", "collector-token")
    cfg = compose_config(config_tree(tmp_path, HEADERS_YAML), [
        "server.host=127.0.0.1", "server.port=0", f"model.path={tiny_model_dir}", "model.name=tiny",
        "model.max_model_len=512", "model.device=cpu", "reconcile.watch=false", "tracing.enabled=true",
        f"tracing.otlp_endpoint={collector.url}", "tracing.service_name=appliance-test"])
    from appliance.server.run import build_request_tracer

    tracer = build_request_tracer(cfg)
    srv = ServerThread(cfg, tracer=tracer).start()
    try:
        trace_id, _, headers = caller()
        r = requests.post(srv.url + "/v1/completions", headers=headers, timeout=60,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200
    finally:
        srv.stop()  # the server's shutdown exports what the batch processor still holds
        collector.server.shutdown()
    path, sent, req = collector.requests[0]
    assert path == "/v1/traces" and sent["authorization"] == "Bearer collector-token"
    service = {a.key: a.value.string_value for a in req.resource_spans[0].resource.attributes}["service.name"]
    assert service == "appliance-test"
    mine = {s.name for s in collector.spans() if s.trace_id == trace_id.to_bytes(16, "big")}
    assert mine == {"POST /v1/completions", "queue", "prefill", "decode"}


def test_serve_without_the_extra_stops_before_loading_the_model(tmp_path: Path) -> None:
    import subprocess

    code = ("import sys; sys.modules['opentelemetry'] = None; from appliance.cli import main; "
            "sys.exit(main(['serve', 'tracing.enabled=true', 'model.path=" + str(tmp_path / "absent") + "']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 1, p.stderr
    assert "error: tracing.enabled: the OpenTelemetry packages are not installed" in p.stderr
    assert "pip install 'appliance[tracing]'" in p.stderr
    assert "loading model" not in p.stderr and "Traceback" not in p.stderr


def test_the_tenant_is_an_attribute_and_its_key_is_not(tmp_path: Path, tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    key = "tenant-key-0123456789"
    monkeypatch.setenv("APPLIANCE_TEST_TENANT_KEY", key)
    tree = config_tree(tmp_path, '\ntenants:\n  team-t:\n    keys: ["${oc.env:APPLIANCE_TEST_TENANT_KEY}"]\n')
    cfg = compose_config(tree, ["server.host=127.0.0.1", "server.port=0", f"model.path={tiny_model_dir}",
                                "model.name=tiny", "model.max_model_len=512", "model.device=cpu",
                                "reconcile.watch=false", "tracing.enabled=true"])
    exporter = InMemorySpanExporter()
    tracer = build_tracer(cfg.tracing, exporter)
    srv = ServerThread(cfg, tracer=tracer).start()
    try:
        trace_id, _, headers = caller()
        r = requests.post(srv.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                          headers={**headers, "Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        spans = finished(tracer, exporter, trace_id)
        (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
        assert server.attributes["appliance.tenant"] == "team-t" and "appliance.adapter" not in server.attributes
        assert all(key not in str(dict(s.attributes)) for s in spans)
    finally:
        srv.stop()


def test_unsampled_callers_and_probes_leave_no_spans(traced: Traced) -> None:
    trace_id, span_id, _ = caller()
    r = requests.post(traced.srv.url + "/v1/completions", timeout=60,
                      headers={"traceparent": f"00-{trace_id:032x}-{span_id:016x}-00"},
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    probe, _, headers = caller()
    assert requests.get(traced.srv.url + "/health", headers=headers, timeout=30).status_code == 200
    traced.settled()
    assert traced.recorded(trace_id) == []  # the caller did not sample it: parent-based sampling
    assert traced.recorded(probe) == []


def test_errors_are_traced_with_their_status(traced: Traced) -> None:
    trace_id, _, headers = caller()
    r = requests.post(traced.srv.url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": "no-such-adapter", "prompt": "Hi"})
    assert r.status_code == 404
    (server,) = traced.spans(trace_id)
    assert server.attributes["http.response.status_code"] == 404 and server.status.status_code is StatusCode.UNSET
    trace_id, _, headers = caller()
    requests.get(traced.srv.url + "/no/such/route", headers=headers, timeout=30)
    (server,) = traced.spans(trace_id)
    assert server.name == "GET" and "http.route" not in server.attributes


def test_tracing_off_creates_no_spans(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A global provider catches anything that would use the OpenTelemetry API without our tracer.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    srv = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=512",
                       "model.device=cpu")
    try:
        assert srv.cfg.tracing.enabled is False and srv.server.tracer is None
        caplog.set_level(logging.INFO, logger="appliance.request")
        _, _, headers = caller()
        for stream in (False, True):
            r = requests.post(srv.url + "/v1/completions", headers={**headers, "X-Request-Id": f"off-{stream}"},
                              timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": stream})
            assert r.status_code == 200
        deadline = time.monotonic() + 30  # each request's end: where its span would have ended
        while {"off-False", "off-True"} - {getattr(r, "request_id", None) for r in caplog.records}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        provider.force_flush()
        assert exporter.get_finished_spans() == ()
    finally:
        srv.stop()


@pytest.mark.parametrize("override, message", [
    ("tracing.sample_ratio=1.5", "tracing.sample_ratio: must be in [0, 1]"),
    ("tracing.otlp_endpoint=collector:4317", "tracing.otlp_endpoint: must be an http:// or https:// URL"),
    ("tracing.service_name=''", "tracing.service_name: must not be empty"),
])
def test_config_errors_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        default_config("tracing.enabled=true", override)


HEADERS_YAML = "\ntracing:\n  headers:\n    authorization: \"Bearer ${oc.env:APPLIANCE_TEST_OTLP_TOKEN}\"\n"


def test_an_unset_header_variable_names_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_TEST_OTLP_TOKEN", "")
    tree = config_tree(tmp_path, HEADERS_YAML.replace("Bearer ", ""))
    with pytest.raises(ConfigError, match="tracing.headers.authorization: header names and values must not be empty"):
        compose_config(tree, [])


def test_missing_packages_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.server.run import build_request_tracer

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if the extra were not installed
    cfg = default_config("tracing.enabled=true")
    with pytest.raises(ConfigError, match=r"tracing.enabled: .*pip install 'appliance\[tracing\]'"):
        build_request_tracer(cfg)
    assert build_request_tracer(default_config()) is None  # off: nothing of OpenTelemetry is needed


def test_headers_are_never_echoed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.cli import main
    from appliance.config.restart import restart_settings

    monkeypatch.setenv("APPLIANCE_TEST_OTLP_TOKEN", "s3cr3t-token")
    tree = config_tree(tmp_path, HEADERS_YAML)
    cfg = compose_config(tree, [])
    assert cfg.tracing.headers == {"authorization": "Bearer s3cr3t-token"}  # what the exporter sends
    assert "tracing.headers" not in restart_settings(cfg)  # /v1/status's settings map
    assert main(["config", "show", "--config-dir", str(tree)]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out and "authorization:" in out
