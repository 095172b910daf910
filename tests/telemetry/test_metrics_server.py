"""GET /metrics on a real server (tiny model, real engine, peft adapters): exact counts, slot gauges
and evictions against the pool's own state, label hygiene, promtool's lint, auth and the off switch."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import requests

from tests.telemetry.helpers import (MODEL, Scrape, adapters_state, complete, load, lora_server,
                                   make_adapters, promtool_check_metrics, scrape, scrape_text)
from tests.server.conftest import ServerThread, start_server


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    return make_adapters(tmp_path_factory.mktemp("metrics-adapters"), tiny_model_dir)


@pytest.fixture()
def srv(adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> Iterator[ServerThread]:
    """A fresh server per test (the counts below are from zero), the three adapters loaded."""
    server = lora_server(tiny_model_dir, next(iter(adapter_dirs.values())).parent)
    for name, path in adapter_dirs.items():
        load(server, name, path)
    yield server
    server.stop()


def hist_count(s: Scrape, name: str, adapter: str) -> float:
    return s.get(name + "_count", adapter=adapter)


def test_k_requests_for_an_adapter_count_k(srv: ServerThread) -> None:
    k, new = 3, 4
    outs = [complete(srv, "qv4", max_tokens=new) for _ in range(k)]
    base = complete(srv, MODEL, max_tokens=new)
    s = scrape(srv)
    for name in ("appliance_time_to_first_token_seconds", "appliance_e2e_request_latency_seconds",
                 "appliance_request_queue_time_seconds"):
        assert hist_count(s, name, "qv4") == k, name
        assert hist_count(s, name, "base") == 1, name
    assert s.get("appliance_requests_total", adapter="qv4", finish_reason="length") == k
    assert s.get("appliance_requests_total", adapter="base", finish_reason="length") == 1
    assert hist_count(s, "appliance_inter_token_latency_seconds", "qv4") == k * (new - 1)
    # Token counters equal the usage the responses reported.
    usage = [o["usage"] for o in outs + [base]]
    assert s.get("appliance_generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    assert s.get("appliance_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    # Adapters never used have no latency series; the e2e sum is a real duration.
    assert ("appliance_e2e_request_latency_seconds_count", frozenset({("adapter", "mlp6")})) not in s.samples
    assert s.get("appliance_e2e_request_latency_seconds_sum", adapter="qv4") > 0
    assert s.get("appliance_requests_running") == 0
    assert sum(s.get("appliance_requests_waiting", reason=r) for r in ("slot", "kv", "budget", "load")) == 0


def test_slot_gauges_and_evictions_follow_the_pool(srv: ServerThread, adapter_dirs: dict[str, Path]) -> None:
    # 2 slots, 3 adapters in turn, LRU: qv4 -> slot 0, mlp6 -> slot 1, then every request evicts.
    order = ["qv4", "mlp6", "down2", "qv4", "mlp6", "down2"]
    for name in order:
        complete(srv, name, max_tokens=2)
    state = adapters_state(srv)
    s = scrape(srv)
    pool, cache = state["pool"], state["cache"]
    assert pool["evictions"] == 4
    assert s.get("appliance_lora_evictions_total", tier="gpu", policy="lru") == 4
    assert s.get("appliance_lora_slots") == pool["slots"] == 2
    assert s.get("appliance_lora_slots_used") == pool["used"] == 2
    assert s.get("appliance_lora_slots_pinned") == pool["pinned"] == 0
    tiers = [a["tier"] for a in state["data"]]
    assert s.get("appliance_lora_adapters", tier="gpu") == tiers.count("gpu") == 2
    assert s.get("appliance_lora_adapters", tier="cpu") == tiers.count("cpu") == 1
    assert s.get("appliance_lora_adapters", tier="registered") == len(tiers) == 3
    # One slot fill per request that missed; three disk reads (the admin loads), nothing failed.
    assert s.get("appliance_lora_loads_total", tier="gpu", result="success") == len(order)
    assert s.get("appliance_lora_loads_total", tier="cpu", result="success") == cache["loads"] == 3
    assert s.get("appliance_lora_loads_total", tier="gpu", result="error") == 0
    assert s.get("appliance_lora_load_duration_seconds_count", tier="gpu") == len(order)
    assert s.get("appliance_lora_evictions_total", tier="cpu", policy="lru") == cache["evictions"] == 0
    assert s.get("appliance_lora_slot_wait_seconds_count") == len(order)
    # Pinning takes a slot by the same rule: one more eviction, one pinned slot.
    r = requests.post(srv.url + "/load_lora_adapter", headers={"Authorization": "Bearer secret"}, timeout=60,
                      json={"lora_name": "qv4", "lora_path": str(adapter_dirs["qv4"]), "pinned": True,
                            "load_inplace": True})
    assert r.status_code == 200, r.text
    state, s = adapters_state(srv), scrape(srv)
    assert s.get("appliance_lora_slots_pinned") == state["pool"]["pinned"] == 1
    assert s.get("appliance_lora_slots_used") == state["pool"]["used"]
    assert s.get("appliance_lora_evictions_total", tier="gpu", policy="lru") == state["pool"]["evictions"]


def test_host_tier_evictions_and_reloads_match_the_cache(adapter_dirs: dict[str, Path],
                                                         tiny_model_dir: Path) -> None:
    # Host memory for 2 adapters and 3 in turn: the CPU tier evicts and reads adapters from disk again.
    server = lora_server(tiny_model_dir, next(iter(adapter_dirs.values())).parent, "lora.max_loaded_loras=2")
    try:
        for name, path in adapter_dirs.items():
            load(server, name, path)
        for name in ["qv4", "mlp6", "down2", "qv4"]:
            complete(server, name, max_tokens=2)
        cache, s = adapters_state(server)["cache"], scrape(server)
        assert cache["evictions"] > 0 and cache["loads"] > 3  # the scenario really exercised the tier
        assert s.get("appliance_lora_evictions_total", tier="cpu", policy="lru") == cache["evictions"]
        assert s.get("appliance_lora_loads_total", tier="cpu", result="success") == cache["loads"]
        assert s.get("appliance_lora_load_duration_seconds_count", tier="cpu") == cache["loads"]
    finally:
        server.stop()


def test_unknown_models_and_bad_input_change_nothing(srv: ServerThread) -> None:
    complete(srv, "qv4", max_tokens=2)
    before = scrape_text(srv)
    bad = [
        ("/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}),
        ("/v1/completions", {"model": f"{MODEL}:nope", "prompt": "x", "max_tokens": 2}),
        ("/v1/completions", {"model": "other", "prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "x"}]}),
        ("/generate", {"text": "x", "lora_path": "nope2", "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/completions", {"model": "qv4", "prompt": "x", "max_tokens": -1}),
    ]
    for path, body in bad:
        r = requests.post(srv.url + path, json=body, timeout=30)
        assert r.status_code in (400, 404), (path, body, r.status_code)
    r = requests.post(srv.url + "/v1/completions", data=b"{not json", timeout=30)
    assert r.status_code == 400
    after = scrape_text(srv)
    # Only the request counters moved: by status code (the 400s and 404s are what its panels show) and
    # by tenant (every request a key sent; the open server's is "(none)").
    http = "appliance_http_requests_total"
    moved = (http, "appliance_tenant_requests_total")
    assert [ln for ln in after.splitlines() if not ln.startswith(moved)] == \
        [ln for ln in before.splitlines() if not ln.startswith(moved)]
    assert Scrape(after).get("appliance_tenant_requests_total", tenant="(none)") == \
        Scrape(before).get("appliance_tenant_requests_total", tenant="(none)") + len(bad) + 1
    assert Scrape(after).get(http, route="/v1/completions", code="404") == 3
    used = {dict(lbls)["adapter"] for (n, lbls) in Scrape(after).samples
            if "adapter" in dict(lbls) and n != "appliance_lora_adapter_resident"}  # that one: every loaded adapter
    assert used == {"base", "qv4"}


def test_promtool_lints_a_live_page_after_adapter_traffic(srv: ServerThread) -> None:
    for name in ["qv4", "mlp6", "down2", MODEL]:
        complete(srv, name, max_tokens=3)
    text = scrape_text(srv)
    assert 'adapter="mlp6"' in text and "appliance_build_info{" in text
    res = promtool_check_metrics(text)
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr
    # promtool does catch problems: a counter without _total is reported.
    broken = "# HELP x_requests Requests.\n# TYPE x_requests counter\nx_requests 1\n"
    assert promtool_check_metrics(broken).returncode != 0


def test_build_info_and_startup_config_gauges(srv: ServerThread) -> None:
    from appliance import __version__

    s = scrape(srv)
    assert s.get("appliance_build_info", version=__version__, model=MODEL, backend="torch") == 1
    assert s.get("appliance_config_generation") == 1
    assert s.get("appliance_config_last_reload_successful") == 1
    assert s.get("appliance_config_last_reload_success_timestamp_seconds") > 1.7e9
    assert s.get("appliance_reconcile_total", result="success") == 0


def test_metrics_key_and_off_switch(tiny_model_dir: Path) -> None:
    common = (f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=512", "model.device=cpu")
    keyed = start_server(*common, "server.api_keys=[k1]", "metrics.require_key=true")
    try:
        assert requests.get(keyed.url + "/metrics", timeout=30).status_code == 401
        wrong = requests.get(keyed.url + "/metrics", headers={"Authorization": "Bearer k2"}, timeout=30)
        assert wrong.status_code == 401
        s = scrape(keyed, headers={"Authorization": "Bearer k1"})
        assert s.get("appliance_lora_slots") == 0  # LoRA off: no slots, still exported
    finally:
        keyed.stop()
    off = start_server(*common, "metrics.enabled=false")
    try:
        assert requests.get(off.url + "/metrics", timeout=30).status_code == 404
        complete(off, MODEL, max_tokens=2)  # the engine runs without a stats sink
    finally:
        off.stop()
