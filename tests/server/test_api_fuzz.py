"""Fuzz the live HTTP API from its own OpenAPI document (GET /openapi.json) with schemathesis.

For every operation, schemathesis generates requests that fit the document (positive) and requests
that break it (negative: wrong types, missing fields, extra keys, odd strings). Each answer must be:
below 500; when an error, exactly the OpenAI error shape; when a stream, well-formed events ending in
[DONE], any error event in the OpenAI shape. Afterwards the server is healthy, idle, and still answers
correctly. The runs are derandomized (same cases every run). FUZZ_EXAMPLES raises the examples per
operation and mode for a longer local run (default 12).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest
import requests

from tests.lora.test_lora_engine import make_adapter
from tests.server.conftest import ServerThread, start_with_adapter

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (after the importorskip)
from schemathesis import GenerationMode  # noqa: E402

ADMIN = {"Authorization": "Bearer fuzz-admin"}
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
MAX_STREAM_EVENTS = 1_000_000  # above any stream the fuzzed server can send (the 60 s timeout still cuts)
# Aliases answer from the same handler as their twin; fuzzing one of each pair is enough.
ALIASES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/pin_lora_adapter"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("fuzz-adapters")
    make_adapter(tiny_model_dir, root / "fz", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"])
    # A short context keeps every generated request fast; LoRA on, so the admin routes do real work.
    s = start_with_adapter(tiny_model_dir, root, "fz", "fuzz-admin", "model.max_model_len=48",
                           "engine.num_kv_blocks=64", "lora.max_loras_per_batch=2",
                           "server.max_request_body_bytes=65536", "server.log_level=warning")
    yield s
    s.stop()


def header(r, name: str) -> str:
    """A header of a schemathesis Response (values are lists) or a requests one."""
    for k, v in r.headers.items():
        if k.lower() == name:
            return v[0] if isinstance(v, list) else v
    return ""


def check_response(r) -> None:
    where = f"{r.request.method} {r.request.url} -> {r.status_code}: {r.text[:300]}"
    assert r.status_code < 500, where
    # schemathesis stops reading a stream at max_stream_events or the timeout: a cut stream proves nothing.
    assert not getattr(r, "stream_cut_short", False), f"schemathesis stopped reading the stream: {where}"
    ctype = header(r, "content-type")
    if r.status_code >= 400:
        err = r.json().get("error")
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), where
        if r.status_code == 429:
            assert header(r, "retry-after"), where
    elif ctype.startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line.strip()]
        assert events and events[-1] == "[DONE]", where
        for e in events[:-1]:
            body = json.loads(e)
            if "error" in body:
                assert set(body["error"]) == {"message", "type", "param", "code"}, where
    elif not ctype.startswith("text/plain"):  # text/plain: GET /metrics, where the metrics subsystem exists
        assert ctype.startswith("application/json"), where
        r.json()


@pytest.fixture(scope="module")
def schema(srv: ServerThread):
    # schemathesis reads only the first 20 events of a stream by default; ours end, so read them whole.
    config = schemathesis.config.SchemathesisConfig.from_dict({"max-stream-events": MAX_STREAM_EVENTS})
    return schemathesis.openapi.from_url(srv.url + "/openapi.json", config=config)


def operations(schema) -> list:
    ops = [res.ok() for res in schema.get_all_operations()]
    return [op for op in ops if op.path not in ALIASES]


def test_openapi_document_describes_every_route(srv: ServerThread, schema) -> None:
    doc = requests.get(srv.url + "/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.1")  # generated from the pydantic models (JSON Schema 2020-12)
    routes = {(m, r.path) for r in srv.server.config.app.routes for m in r.methods if m != "HEAD"}
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert described == routes
    assert {op.path for op in operations(schema)} >= {"/v1/completions", "/generate", "/load_lora_adapter"}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_no_5xx_and_openai_errors(srv: ServerThread, schema, mode: GenerationMode) -> None:
    session = requests.Session()
    seen: dict[int, int] = {}
    for op in operations(schema):
        if mode is GenerationMode.NEGATIVE and op.method.upper() == "GET":
            continue  # nothing to break: no body, no parameters (bad bodies on GET routes: see below)
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
                  print_blob=True)
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case) -> None:
            r = case.call(base_url=srv.url, session=session, headers=ADMIN, timeout=60)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            check_response(r)

        run()
    print(f"\n{mode.value}: status counts {dict(sorted(seen.items()))}")
    if mode is GenerationMode.NEGATIVE:  # raw bodies that no schema describes
        for raw in (b"", b"null", b"[]", b"{", b'{"model": NaN}', b"\xff\xfe", b'{"a":' * 5000, b'"x"'):
            for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/load_lora_adapter"):
                r = session.post(srv.url + path, data=raw, headers={**ADMIN, "Content-Type": "application/json"},
                                 timeout=60)
                assert r.status_code == 400, (path, raw[:20], r.text)
                check_response(r)
    assert sum(seen.values()) >= len(operations(schema))
    # Healthy, idle, and still right afterwards.
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    assert srv.wait_idle(30) and srv.engine.engine.block_manager.num_used == 0
    body = {"model": "tiny", "prompt": [1, 504, 3458], "max_tokens": 4, "temperature": 0}
    r1 = requests.post(srv.url + "/v1/completions", json=body, timeout=30)
    r2 = requests.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r1.status_code == 200 and r1.json()["choices"] == r2.json()["choices"]
