"""The fleet metrics on a real server (tiny model, real engine, peft adapters): HTTP requests by route
template and code, adapter residency, and the Gateway API Inference Extension's model-server protocol
metrics (metrics.gateway_compat) as its endpoint picker reads them, changing as adapters start and
stop running."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests

from tests.server.conftest import ServerThread
from tests.telemetry.helpers import (ADMIN, MODEL, Scrape, complete, load, lora_server, make_adapters,
                                   promtool_check_metrics, scrape, scrape_text)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    return make_adapters(tmp_path_factory.mktemp("fleet-adapters"), tiny_model_dir)


@pytest.fixture()
def srv(adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> Iterator[ServerThread]:
    """One request at a time (engine.max_num_seqs=1), so a second one waits; gateway metrics on."""
    server = lora_server(tiny_model_dir, next(iter(adapter_dirs.values())).parent, "metrics.gateway_compat=true",
                         "engine.max_num_seqs=1")
    for name, path in adapter_dirs.items():
        load(server, name, path)
    yield server
    server.stop()


def lora_info(s: Scrape) -> dict[str, str]:
    """The one `vllm:lora_requests_info` series' labels, its value checked to be a recent timestamp."""
    series = [(dict(lbls), v) for (name, lbls), v in s.samples.items() if name == "vllm:lora_requests_info"]
    assert len(series) == 1, series
    labels, value = series[0]
    assert abs(value - time.time()) < 60, value
    return labels


def wait_for(srv: ServerThread, cond: Callable[[Scrape], bool], timeout_s: float = 60) -> Scrape:
    deadline = time.monotonic() + timeout_s
    while True:
        s = scrape(srv)
        if cond(s):
            return s
        assert time.monotonic() < deadline, s.text
        time.sleep(0.02)


def test_http_requests_count_route_templates_and_codes(srv: ServerThread) -> None:
    complete(srv, "qv4", max_tokens=2)
    assert requests.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30).status_code == 404
    assert requests.post(srv.url + "/v1/completions", data=b"{bad", timeout=30).status_code == 400
    assert requests.get(srv.url + "/no/such/path-4f2a", timeout=30).status_code == 404
    assert requests.get(srv.url + "/v1/completions", timeout=30).status_code == 405
    assert requests.post(srv.url + "/load_lora_adapter", json={}, timeout=30).status_code == 401
    s = scrape(srv)
    name = "appliance_http_requests_total"
    assert s.get(name, route="/v1/completions", code="200") == 1
    assert s.get(name, route="/v1/completions", code="404") == 1
    assert s.get(name, route="/v1/completions", code="400") == 1
    assert s.get(name, route="/v1/completions", code="405") == 1
    assert s.get(name, route="unmatched", code="404") == 1
    assert s.get(name, route="/load_lora_adapter", code="401") == 1
    assert s.get(name, route="/load_lora_adapter", code="200") == 3  # the fixture's loads
    assert "path-4f2a" not in s.text  # a raw path never becomes a label
    assert s.families["appliance_http_requests"] == "counter"


def test_residency_gauge_follows_tiers_pins_and_unloads(srv: ServerThread, adapter_dirs: dict[str, Path]) -> None:
    def resident(s: Scrape) -> set[tuple[str, str, str, str]]:
        return {(d["adapter"], d["tier"], d["pinned"], d["rank"])
                for (n, lbls), v in s.samples.items() if n == "appliance_lora_adapter_resident"
                for d in [dict(lbls)] if v == 1}

    # Loaded through the admin API: all three in host memory, none in a slot yet.
    assert resident(scrape(srv)) == {("qv4", "cpu", "false", "4"), ("mlp6", "cpu", "false", "6"),
                                     ("down2", "cpu", "false", "2")}
    complete(srv, "qv4", max_tokens=2)
    complete(srv, "mlp6", max_tokens=2)
    assert resident(scrape(srv)) == {("qv4", "gpu", "false", "4"), ("mlp6", "gpu", "false", "6"),
                                     ("down2", "cpu", "false", "2")}
    r = requests.post(srv.url + "/load_lora_adapter", headers=ADMIN, timeout=60, json={
        "lora_name": "down2", "lora_path": str(adapter_dirs["down2"]), "pinned": True, "load_inplace": True})
    assert r.status_code == 200, r.text
    got = resident(scrape(srv))
    assert ("down2", "gpu", "true", "2") in got and len(got) == 3
    r = requests.post(srv.url + "/unload_lora_adapter", headers=ADMIN, timeout=60, json={"lora_name": "mlp6"})
    assert r.status_code == 200, r.text
    assert {a for a, *_ in resident(scrape(srv))} == {"qv4", "down2"}


def _stream(srv: ServerThread, model: str, max_tokens: int, started: threading.Event,
            stop: threading.Event) -> None:
    with requests.post(srv.url + "/v1/completions", stream=True, timeout=120, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                break


def test_gateway_metrics_follow_running_and_waiting_adapters(srv: ServerThread) -> None:
    s = scrape(srv)
    assert lora_info(s) == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}
    for n in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:gpu_cache_usage_perc",
              "vllm:kv_cache_usage_perc"):
        assert s.families[n] == "gauge" and s.get(n, model_name=MODEL) == 0, n

    # A long stream on qv4 runs (max_num_seqs=1), a request for mlp6 waits behind it.
    started, stop = threading.Event(), threading.Event()
    a = threading.Thread(target=_stream, args=(srv, "qv4", 480, started, stop), daemon=True)
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=complete, args=(srv, "mlp6", 2), daemon=True)
    b.start()
    s = wait_for(srv, lambda s: lora_info(s)["waiting_lora_adapters"] == "mlp6")
    assert lora_info(s)["running_lora_adapters"] == "qv4"
    assert s.get("vllm:num_requests_running", model_name=MODEL) == 1
    assert s.get("vllm:num_requests_waiting", model_name=MODEL) == 1
    assert 0 < s.get("vllm:kv_cache_usage_perc", model_name=MODEL) == s.get("appliance_kv_cache_usage_ratio")
    # promtool's lint wants no ':' in names (recording rules' convention); vLLM's names have one, on
    # purpose: that is all it finds.
    res = promtool_check_metrics(s.text)
    gateway = {n for n in s.families if n.startswith("vllm:")}
    assert set((res.stdout + res.stderr).strip().splitlines()) == {
        f"{n} metric names should not contain ':'" for n in gateway}

    stop.set()  # the client leaves: qv4 stops running, mlp6 runs and finishes
    a.join(60)
    b.join(60)
    assert srv.wait_idle()
    s = wait_for(srv, lambda s: lora_info(s)["running_lora_adapters"] == "")
    assert lora_info(s)["waiting_lora_adapters"] == ""
    assert s.get("vllm:num_requests_running", model_name=MODEL) == 0


def test_gateway_metrics_are_off_by_default(adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    server = lora_server(tiny_model_dir, next(iter(adapter_dirs.values())).parent)
    try:
        assert "vllm:" not in scrape_text(server)
    finally:
        server.stop()
