"""SIGTERM on a real `appliance.server.run.serve` process (tiny model): drain, 503s meanwhile, exit 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Iterator, Optional

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`appliance.server.run.serve` in a child process on the tiny model; `out` = where its output goes
    (default: a pipe, read by output()); `new_session`: its own process group, like a shell job."""

    def __init__(self, model_dir: Path, *overrides: str, out: Optional[IO] = None, new_session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [f"model.path={model_dir}", "model.name=tiny", "model.max_model_len=512", "model.device=cpu",
                     "server.host=127.0.0.1", f"server.port={self.port}", *overrides]
        code = ("from tests.conftest import default_config\n"
                "from appliance.server.run import serve\n"
                f"serve(default_config(*{self.args!r}))\n")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                                     stdout=out or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=new_session)

    def output(self) -> str:
        return self.proc.stdout.read() if self.proc.stdout is not None else "(output not piped)"

    def wait_healthy(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.1)

    def stream(self, max_tokens: int) -> "StreamThread":
        return StreamThread(self.url, max_tokens)


class StreamThread(threading.Thread):
    """A long streaming /v1/completions request, read in the background."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.started_streaming = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "Go on:", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    self.events.append(line.decode().removeprefix("data: "))
                    self.started_streaming.set()

    def finish_reasons(self) -> list[str]:
        out = []
        for e in self.events[:-1]:
            for c in json.loads(e).get("choices", []):
                if c["finish_reason"]:
                    out.append(c["finish_reason"])
        return out


@pytest.fixture
def serve_proc(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[ServeProcess]:
    p = ServeProcess(tiny_model_dir, *request.param)
    yield p
    if p.proc.poll() is None:
        p.proc.kill()
        p.proc.wait()


@pytest.mark.parametrize("serve_proc", [("server.shutdown_timeout_s=60",)], indirect=True)
def test_sigterm_drains_in_flight_then_exits_0(serve_proc: ServeProcess) -> None:
    serve_proc.wait_healthy()
    stream = serve_proc.stream(max_tokens=250)  # a few seconds on the tiny model
    assert stream.started_streaming.wait(30)
    serve_proc.proc.send_signal(signal.SIGTERM)

    deadline = time.monotonic() + 5
    while (r := requests.get(serve_proc.url + "/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 after SIGTERM"
        time.sleep(0.02)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    r = requests.post(serve_proc.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    assert stream.is_alive(), "the stream ended before the drain could be observed"

    stream.join(60)
    assert stream.events[-1] == "[DONE]" and stream.finish_reasons() == ["length"]
    assert serve_proc.proc.wait(30) == 0, serve_proc.proc.stdout.read()


@pytest.mark.parametrize("serve_proc", [("server.shutdown_timeout_s=0.5",)], indirect=True)
def test_sigterm_aborts_after_shutdown_timeout(serve_proc: ServeProcess) -> None:
    serve_proc.wait_healthy()
    stream = serve_proc.stream(max_tokens=480)
    assert stream.started_streaming.wait(30)
    t0 = time.monotonic()
    serve_proc.proc.send_signal(signal.SIGTERM)
    stream.join(30)
    assert serve_proc.proc.wait(30) == 0, serve_proc.proc.stdout.read()
    assert time.monotonic() - t0 < 10
    # The cut-off stream ends with an error event and [DONE], not with a silent truncation.
    assert stream.events[-1] == "[DONE]"
    assert json.loads(stream.events[-2])["error"]["code"] == "engine_stopped"
