"""Request tracing on a real server: X-Request-Id honoured when safe, replaced when not, echoed, and
used as the OpenAI `id` suffix (checked through the official openai client); one request line per
finished request, JSON that parses under logging.format=json (a real `serve` process)."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Iterator

import openai
import pytest
import requests

from appliance.server.request_log import request_id_from
from tests.server.conftest import ServerThread, start_server
from tests.server.test_shutdown import ServeProcess

HEX32 = r"[0-9a-f]{32}"


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=512",
                          "model.device=cpu")
    yield server
    server.stop()


def test_request_id_rule() -> None:
    for ok in ("abc-123", "trace.1:span_2", "a" * 128):
        assert request_id_from(ok) == ok
    for bad in (None, "", "a" * 129, "has space", "new\nline", "ü", "a;b", "<x>"):
        got = request_id_from(bad)
        assert got != bad and len(got) == 32 and int(got, 16) >= 0


def test_openai_client_sees_its_id_in_header_and_body(srv: ServerThread) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_headers={"X-Request-Id": "order-42.a"})
    assert raw.headers["x-request-id"] == "order-42.a"
    assert raw.parse().id == "chatcmpl-order-42.a"
    chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=3, stream=True,
                                            extra_headers={"X-Request-Id": "s-1"}))
    assert chunks and {c.id for c in chunks} == {"cmpl-s-1"}


def test_unsafe_or_missing_ids_are_replaced_and_echoed(srv: ServerThread) -> None:
    for sent in ({}, {"X-Request-Id": "x" * 200}, {"X-Request-Id": "a b"}):
        r = requests.post(srv.url + "/v1/completions", headers=sent, timeout=60,
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        rid = r.headers["X-Request-Id"]
        assert len(rid) == 32 and int(rid, 16) >= 0 and rid != sent.get("X-Request-Id")
        assert r.json()["id"] == f"cmpl-{rid}"
    # Errors and the other routes echo it too; /generate's items carry it.
    r = requests.post(srv.url + "/v1/completions", headers={"X-Request-Id": "e1"}, json={"model": "nope"}, timeout=30)
    assert r.status_code in (400, 404) and r.headers["X-Request-Id"] == "e1"
    assert requests.get(srv.url + "/health", headers={"X-Request-Id": "h1"}, timeout=30).headers["X-Request-Id"] == "h1"
    r = requests.post(srv.url + "/generate", headers={"X-Request-Id": "g1"}, timeout=60,
                      json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "gen-g1"


def test_the_same_client_id_twice_at_once_runs_both(srv: ServerThread) -> None:
    codes: list[int] = []

    def one() -> None:
        r = requests.post(srv.url + "/v1/completions", headers={"X-Request-Id": "dup"}, timeout=120,
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 16, "ignore_eos": True})
        codes.append(r.status_code)
        assert r.json()["id"] == "cmpl-dup"

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert codes == [200, 200, 200]


def test_json_logs_one_line_per_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = (tmp_path / "serve.log").open("w")
    p = ServeProcess(tiny_model_dir, "logging.format=json", out=out)
    try:
        p.wait_healthy()
        ok = requests.post(p.url + "/v1/completions", headers={"X-Request-Id": "log-ok"}, timeout=60,
                           json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200
        usage = ok.json()["usage"]
        with requests.post(p.url + "/v1/chat/completions", headers={"X-Request-Id": "log-stream"}, stream=True,
                           timeout=60, json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                             "max_tokens": 2, "stream": True}) as r:
            assert r.status_code == 200 and b"[DONE]" in r.content
        bad = requests.post(p.url + "/v1/completions", headers={"X-Request-Id": "log-404"}, timeout=60,
                            json={"model": "nope", "prompt": "Hi"})
        assert bad.status_code == 404
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(60) == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
        out.close()
    text = (tmp_path / "serve.log").read_text()
    records = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    assert records and all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    # Every line the logging module wrote is JSON: uvicorn's too, none left as text.
    assert not [ln for ln in text.splitlines() if ln.startswith("INFO") or " INFO " in ln], text
    lines = [r for r in records if r["logger"] == "appliance.request"]
    by_id = {r["request_id"]: r for r in lines}
    health = [r for r in lines if r["route"] == "/health"]
    assert len(lines) == len(by_id) == 3 + len(health)  # one per request, the probes' included
    okl, streamed, missing = by_id["log-ok"], by_id["log-stream"], by_id["log-404"]
    assert okl["route"] == "/v1/completions" and okl["status"] == 200 and okl["adapter"] is None
    assert okl["tenant"] is None  # no tenants configured
    assert (okl["prompt_tokens"], okl["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert 0 < okl["ttft_s"] <= okl["e2e_s"]
    assert streamed["route"] == "/v1/chat/completions" and streamed["status"] == 200
    assert streamed["completion_tokens"] == 2 and streamed["ttft_s"] <= streamed["e2e_s"]
    assert missing["status"] == 404 and missing["prompt_tokens"] is None
