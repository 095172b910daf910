"""The server under test: `appliance serve` started in a subprocess on a free 127.0.0.1 port (or a server
already running at a URL), and the few plain HTTP calls the bench makes besides the load: /health,
/v1/models, /metrics and the admin API's /load_lora_adapter.

Keys travel in the child's environment and in headers, never on a command line or in the report.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from appliance.bench.serve_client import httpx_module
from appliance.bench.serve_options import ADMIN_KEY_ENV
from appliance.config.schema import ConfigError


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick); the server binds it a moment later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m appliance serve [--config-dir D] overrides...` with its output in `log_path`."""

    def __init__(self, config_dir: Optional[str], overrides: Sequence[str], env: dict[str, str],
                 log_path: Path) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "appliance", "serve"]
        if config_dir is not None:
            cmd += ["--config-dir", config_dir]
        self.proc = subprocess.Popen([*cmd, *overrides], stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env})

    def wait_healthy(self, url: str, timeout_s: float) -> None:
        """Return once GET /health answers 200; raise (with the log's tail) if the process exits or
        `timeout_s` passes first."""
        httpx = httpx_module()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"the server exited with status {self.proc.returncode} before it was "
                                  f"healthy; the end of {self.log_path}:\n{self.tail()}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise ConfigError(f"the server was not healthy after {timeout_s:.0f} s (--server-timeout-s); "
                          f"the end of {self.log_path}:\n{self.tail()}")

    def stop(self, timeout_s: float = 60.0) -> Optional[int]:
        """SIGTERM (the server drains and exits), SIGKILL after `timeout_s`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class ServerApi:
    """The non-load calls; `api_key` for inference routes (and /metrics), `admin_key` for admin ones."""

    def __init__(self, url: str, api_key: Optional[str], admin_key: Optional[str]) -> None:
        self.httpx = httpx = httpx_module()
        self.url = url.rstrip("/")
        self.api_key, self.admin_key = api_key, admin_key
        self.http = httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0))

    def _headers(self, key: Optional[str]) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _get(self, path: str) -> Any:
        try:
            r = self.http.get(self.url + path, headers=self._headers(self.api_key))
        except self.httpx.TransportError as e:
            raise ConfigError(f"cannot reach the server at {self.url}: {e!r}") from None
        if r.status_code != 200:
            raise ConfigError(f"GET {self.url}{path} answered {r.status_code}: {r.text[:300]}")
        return r

    def base_card(self) -> dict:
        """The base model's /v1/models card (the one without a parent): its `id`, `max_model_len`."""
        return next(c for c in self._get("/v1/models").json()["data"] if c.get("parent") is None)

    def adapter_names(self) -> list[str]:
        return [c["id"] for c in self._get("/v1/models").json()["data"] if c.get("parent") is not None]

    def metrics(self) -> str:
        return self._get("/metrics").text

    def load_adapter(self, name: str, path: Path) -> bool:
        """POST /load_lora_adapter; False when an adapter of that name is already loaded (409)."""
        if not self.admin_key:
            raise ConfigError(f"loading synthetic adapters needs the server's admin key: set {ADMIN_KEY_ENV} in the "
                              "environment")
        r = self.http.post(self.url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                           headers=self._headers(self.admin_key))
        if r.status_code == 409:
            return False
        if r.status_code != 200:
            raise ConfigError(f"loading adapter {name} from {path} answered {r.status_code}: {r.text[:400]}")
        return True

    def close(self) -> None:
        self.http.close()

