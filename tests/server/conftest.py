"""A real server for the server tests: real engine, real uvicorn on 127.0.0.1, in a background thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import requests

from appliance.config.schema import ApplianceConfig
from appliance.reconcile.controller import ConfigSource
from appliance.server.run import DrainingServer, make_server, start_engine
from tests.conftest import default_config

API_KEY = "test-key"


class ServerThread:
    """`make_server` (what `appliance serve` runs) on a free port, in a thread; `stop()` to end."""

    def __init__(self, cfg: ApplianceConfig, source: Optional[ConfigSource] = None, tracer: Any = None) -> None:
        self.cfg = cfg
        self.engine, metrics = start_engine(cfg)
        # tracer: telemetry/tracing.py's RequestTracer (tests give it an in-memory exporter)
        self.server: DrainingServer = make_server(self.engine, cfg, source, metrics, tracer)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout_s: float = 60.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.port}"
        while requests.get(self.url + "/health", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("/health never answered 200")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self.engine.shutdown()

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """True once the engine has no request in flight (aborts are processed asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while self.engine.num_in_flight or self.engine.engine.has_unfinished():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


def start_server(*overrides: str) -> ServerThread:
    return ServerThread(default_config("server.host=127.0.0.1", "server.port=0", *overrides)).start()


def start_with_adapter(model: Path, root: Path, name: str, admin_key: str, *overrides: str) -> ServerThread:
    """The tiny model with LoRA on (rank 8, adapters under `root`) and `name` loaded from root/name
    through the admin API, as an operator would."""
    srv = start_server(f"model.path={model}", "model.name=tiny", "model.device=cpu", "lora.enabled=true",
                       "lora.max_lora_rank=8", f"lora.adapter_roots=[{root}]", f"server.admin_key={admin_key}",
                       *overrides)
    r = requests.post(srv.url + "/load_lora_adapter", headers={"Authorization": f"Bearer {admin_key}"},
                      timeout=60, json={"lora_name": name, "lora_path": str(root / name)})
    assert r.status_code == 200, r.text
    return srv


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """The tiny random model, no API key, small body limit (for the 413 test)."""
    srv = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=512",
                       "model.device=cpu", "server.max_request_body_bytes=65536")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def default_server(default_model_dir: Path) -> Iterator[ServerThread]:
    """The default SmolLM2-135M-Instruct, with an API key."""
    srv = start_server(f"model.path={default_model_dir}", "model.device=cpu",
                       f"server.api_keys=[{API_KEY}]")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def default_open_server(default_model_dir: Path) -> Iterator[ServerThread]:
    """The default SmolLM2-135M-Instruct, no API key."""
    srv = start_server(f"model.path={default_model_dir}", "model.device=cpu")
    yield srv
    srv.stop()
