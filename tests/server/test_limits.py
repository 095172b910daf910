"""The limits that protect the server, on a live tiny-model server: body size (413), concurrent
requests (429 + Retry-After), engine queue length (429 + Retry-After), per-request timeout (408 for the
body, 504 or a stream error event for the answer), distinct adapters per request (400), and the
config checks of each key. Limits are filled deterministically by holding the engine between steps."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from appliance.config.schema import ConfigError
from tests.conftest import default_config
from tests.server.conftest import ServerThread, start_server
from tests.server.engine_hold import engine_held

BODY = {"model": "tiny", "prompt": [1, 504, 3458], "max_tokens": 4, "temperature": 0}


def _server(model: Path, *overrides: str) -> ServerThread:
    return start_server(f"model.path={model}", "model.name=tiny", "model.max_model_len=256", "model.device=cpu",
                        *overrides)


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path) -> Iterator[ServerThread]:
    srv = _server(tiny_model_dir, "server.max_concurrent_requests=2", "engine.max_waiting_requests=3",
                  "server.request_timeout_s=2", "server.max_request_body_bytes=2048",
                  "server.max_adapters_per_request=2")
    yield srv
    srv.stop()


def error(r: requests.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def wait_until(pred, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


class Call(threading.Thread):
    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: requests.Response | None = None
        self.start()

    def run(self) -> None:
        self.response = requests.post(self.url + "/v1/completions", json=self.body, timeout=120)


def test_body_too_large_is_413(limited: ServerThread) -> None:
    r = requests.post(limited.url + "/v1/completions", json={**BODY, "prompt": "x" * 4096}, timeout=30)
    assert r.status_code == 413 and error(r)["code"] == "request_too_large"


def test_concurrent_limit_answers_429_with_retry_after(limited: ServerThread) -> None:
    limit = limited.server.config.app.state.limit
    with engine_held(limited.engine):
        calls = [Call(limited.url, BODY) for _ in range(2)]
        wait_until(lambda: limit.active == 2)
        r = requests.post(limited.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        err = error(r)
        assert err["code"] == "too_many_requests" and "server.max_concurrent_requests" in err["message"]
        # The limit counts inference routes only: health and admin-free routes still answer.
        assert requests.get(limited.url + "/health", timeout=30).status_code == 200
    for c in calls:
        c.join(60)
        assert c.response is not None and c.response.status_code == 200, c.response.text
    wait_until(lambda: limit.active == 0)  # the count drops just after the last byte is sent
    assert requests.post(limited.url + "/v1/completions", json=BODY, timeout=30).status_code == 200


def test_queue_limit_answers_429_with_retry_after(limited: ServerThread) -> None:
    """engine.max_waiting_requests bounds the engine's queue; a /generate batch of 4 needs 4 places."""
    with engine_held(limited.engine):
        body = {"input_ids": [[1, 504]] * 4, "sampling_params": {"max_new_tokens": 2}}
        r = requests.post(limited.url + "/generate", json=body, timeout=30)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    err = error(r)
    assert err["code"] == "queue_full" and "engine.max_waiting_requests=3" in err["message"]
    assert limited.wait_idle() and limited.engine.engine.block_manager.num_used == 0


def test_timeout_answers_504_and_frees_the_engine(limited: ServerThread) -> None:
    with engine_held(limited.engine):
        r = requests.post(limited.url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 504
    err = error(r)
    assert err["code"] == "timeout" and "server.request_timeout_s (2 s)" in err["message"]
    assert limited.wait_idle() and limited.engine.engine.block_manager.num_used == 0
    assert requests.post(limited.url + "/v1/completions", json=BODY, timeout=30).status_code == 200


def test_timeout_ends_a_started_stream_with_an_error_event(limited: ServerThread) -> None:
    body = {**BODY, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with requests.post(limited.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first.removeprefix(b"data: "))["choices"]
        with engine_held(limited.engine):
            rest = [line.decode().removeprefix("data: ") for line in lines if line]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["error"]["code"] == "timeout"
    assert limited.wait_idle() and limited.engine.engine.block_manager.num_used == 0


def test_slow_body_answers_408(limited: ServerThread) -> None:
    """A client that announces a body and never sends it holds a place for request_timeout_s only."""
    port = limited.server.port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\":")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "request_timeout"
    wait_until(lambda: limited.server.config.app.state.limit.active == 0)


def test_too_many_adapters_in_one_request_is_400(limited: ServerThread) -> None:
    body = {"text": ["a", "b", "c"], "lora_path": ["x", "y", "z"], "sampling_params": {"max_new_tokens": 1}}
    r = requests.post(limited.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400
    err = error(r)
    assert err["param"] == "lora_path" and "server.max_adapters_per_request" in err["message"]


@pytest.mark.parametrize("override, needle", [
    ("server.max_concurrent_requests=-1", "server.max_concurrent_requests"),
    ("server.request_timeout_s=-1", "server.request_timeout_s"),
    ("server.max_adapters_per_request=0", "server.max_adapters_per_request"),
    ("server.max_request_body_bytes=0", "server.max_request_body_bytes"),
    ("debug.fault_injection_token_id=-3", "debug.fault_injection_token_id"),
])
def test_limit_keys_are_checked(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        default_config(override)
