"""Overlap loading behind the real HTTP server: admin loads read off the engine thread, a cold adapter's
request waits (reason "load", visible in /metrics) while other requests are served, then answers with
peft's tokens; a bad load is refused with nothing changed, as without overlap."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Iterator

import pytest
import requests

from appliance.engine.tokenizer import Tokenizer
from tests.lora.test_lora_engine import ADAPTERS, NEW, PROMPTS, make_adapter, peft_greedy
from tests.telemetry.helpers import scrape
from tests.server.conftest import ServerThread, start_server

ADMIN = {"Authorization": "Bearer secret"}
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
NAMES = ("qv4", "all8rs", "mlp6")  # loaded in this order into a CPU tier of 2: qv4 ends up on disk only


@pytest.fixture(scope="module")
def ov_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ov_api")
    dirs = {n: make_adapter(tiny_model_dir, root / n, seed=i, **ADAPTERS[n]) for i, n in enumerate(NAMES)}
    trunc = shutil.copytree(dirs["qv4"], root / "truncated")
    w = trunc / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    dirs["truncated"] = trunc
    dirs["root"] = root
    return dirs


@pytest.fixture(scope="module")
def ov_srv(ov_dirs: dict[str, Path], tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=512",
                          "model.device=cpu", "engine.num_kv_blocks=256", "lora.enabled=true",
                          "lora.max_lora_rank=8", "lora.max_loras_per_batch=2", "lora.max_loaded_loras=2",
                          "lora.overlap_loading=true", "debug.fault_injection_read_delay_s=3",
                          f"lora.adapter_roots=[{ov_dirs['root']}]", "server.admin_key=secret")
    yield server
    server.stop()


def admin_load(srv: ServerThread, name: str, path: Path) -> requests.Response:
    return requests.post(srv.url + "/load_lora_adapter", headers=ADMIN,
                         json={"lora_name": name, "lora_path": str(path)}, timeout=60)


def generate(srv: ServerThread, text: str, lora_path: str | None = None) -> requests.Response:
    body = {"text": text, "sampling_params": GREEDY, **({"lora_path": lora_path} if lora_path else {})}
    return requests.post(srv.url + "/generate", json=body, timeout=120)


def tiers(srv: ServerThread) -> dict[str, str]:
    r = requests.get(srv.url + "/v1/adapters", headers=ADMIN, timeout=30)
    return {a["name"]: a["tier"] for a in r.json()["data"]}


def test_cold_adapter_over_http_waits_for_its_read_while_others_are_served(
        ov_srv: ServerThread, ov_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    for n in NAMES:
        r = admin_load(ov_srv, n, ov_dirs[n])
        assert r.status_code == 200, r.text
    assert tiers(ov_srv) == {"qv4": "disk", "all8rs": "cpu", "mlp6": "cpu"}
    # A bad load is refused after its read on the worker thread, with nothing changed.
    r = admin_load(ov_srv, "bad", ov_dirs["truncated"])
    assert r.status_code == 400 and "corrupt or truncated" in r.json()["error"]["message"], r.text
    assert tiers(ov_srv) == {"qv4": "disk", "all8rs": "cpu", "mlp6": "cpu"}

    tok = Tokenizer(tiny_model_dir)
    want_cold = peft_greedy(tiny_model_dir, ov_dirs["qv4"], [tok.encode(PROMPTS[0])])[0][0]
    want_base = peft_greedy(tiny_model_dir, None, [tok.encode(PROMPTS[1])])[0][0]
    cold: dict[str, requests.Response] = {}
    t = threading.Thread(target=lambda: cold.setdefault("r", generate(ov_srv, PROMPTS[0], "qv4")))
    t.start()
    try:
        for _ in range(200):  # the read sleeps 3 s first: the request shows as waiting for its load
            s = scrape(ov_srv)
            if s.get("appliance_requests_waiting", reason="load") == 1:
                break
        assert s.get("appliance_requests_waiting", reason="load") == 1
        assert s.get("appliance_lora_loads_in_flight", tier="cpu") == 1
        base = generate(ov_srv, PROMPTS[1])  # served while the read runs
        assert base.status_code == 200 and base.json()["output_ids"] == want_base
        assert "r" not in cold, "the base request should not have waited for the cold read"
    finally:
        t.join(timeout=120)
    assert cold["r"].status_code == 200 and cold["r"].json()["output_ids"] == want_cold
    s = scrape(ov_srv)
    assert s.get("appliance_requests_waiting", reason="load") == 0
    assert s.get("appliance_lora_loads_in_flight", tier="cpu") == 0
    assert s.get("appliance_lora_loads_total", tier="cpu", result="success") >= 4  # 3 admin loads + 1 cold read
