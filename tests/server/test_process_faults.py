"""Faults that need a real `serve` process: SIGTERM while adapters load, and a full disk under the logs.

- SIGTERM during loads: streams are in flight and an admin thread loads and unloads adapters back to
  back when SIGTERM arrives. The streams finish (length, [DONE]); every admin call is answered 200,
  or 503 once draining, or finds the listener closed after the exit; the process exits 0.
- A full disk: stdout and stderr (every log line) go to /dev/full, so each write fails with ENOSPC.
  Loading an adapter reads only, so it works; requests are answered; SIGTERM still exits 0.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import IO, Iterator, Optional

import pytest
import requests

from tests.lora.test_lora_engine import make_adapter
from tests.server.test_shutdown import ServeProcess, StreamThread

ADMIN = {"Authorization": "Bearer proc-admin"}


class Serve(ServeProcess):
    """A serve process with LoRA on, two slots, the adapters under `root` and an admin key."""

    def __init__(self, model: Path, root: Path, out: Optional[IO] = None, *extra: str) -> None:
        super().__init__(model, "lora.enabled=true", "lora.max_lora_rank=8", "lora.max_loras_per_batch=2",
                         f"lora.adapter_roots=[{root}]", "server.admin_key=proc-admin",
                         "server.shutdown_timeout_s=60", *extra, out=out)

    def load(self, name: str, path: Path) -> requests.Response:
        return requests.post(self.url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                             json={"lora_name": name, "lora_path": str(path)})


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("proc-adapters")
    for i in range(3):
        make_adapter(tiny_model_dir, root / f"p{i}", seed=90 + i, r=8, lora_alpha=8, target_modules="all-linear")
    return root


@pytest.fixture
def cleanup() -> Iterator[list[Serve]]:
    procs: list[Serve] = []
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


def test_sigterm_while_adapters_load(tiny_model_dir: Path, root: Path, cleanup: list[Serve]) -> None:
    srv = Serve(tiny_model_dir, root)
    cleanup.append(srv)
    srv.wait_healthy()
    assert srv.load("p0", root / "p0").status_code == 200
    # 150 tokens: the streams are a few tokens in at SIGTERM, and the rest (~3 s) is the drain the
    # adapter churn runs through.
    streams = [StreamThread(srv.url, max_tokens=150) for _ in range(2)]
    for s in streams:
        assert s.started_streaming.wait(60)

    answers: list[object] = []
    stop = threading.Event()
    loading = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            name = f"p{1 + i % 2}"
            try:
                r = srv.load(name, root / name)
                answers.append(r.status_code)
                if r.status_code == 200:
                    answers.append(requests.post(srv.url + "/unload_lora_adapter", headers=ADMIN, timeout=60,
                                                 json={"lora_name": name}).status_code)
            except requests.ConnectionError:
                answers.append("closed")  # the listener is gone: only after the drain ended
                return
            loading.set()
            i += 1

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    assert loading.wait(60)
    srv.proc.send_signal(signal.SIGTERM)
    for s in streams:
        s.join(120)
        assert s.events[-1] == "[DONE]" and s.finish_reasons() == ["length"], s.events[-3:]
    assert srv.proc.wait(60) == 0, srv.output()
    stop.set()
    t.join(60)
    assert answers and set(answers) <= {200, 503, "closed"}, answers
    assert 200 in answers


def test_full_disk_under_the_logs(tiny_model_dir: Path, root: Path, cleanup: list[Serve]) -> None:
    with open("/dev/full", "w") as full:
        srv = Serve(tiny_model_dir, root, full, "server.log_level=debug")
        cleanup.append(srv)
        srv.wait_healthy()
        assert srv.load("p0", root / "p0").status_code == 200
        for model in ("tiny", "p0"):
            r = requests.post(srv.url + "/v1/completions", timeout=60,
                              json={"model": model, "prompt": [1, 504, 3458], "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        bad = requests.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
        assert bad.status_code == 404  # an error path that logs
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
