"""appliance/telemetry/metrics.py without a server: label bounds, the reconciler's API, events onto collectors."""

from __future__ import annotations

import pytest

from appliance.config.schema import MetricsConfig
from appliance.telemetry.stats import AdapterLoad, EngineEvents, EngineSnapshot, FinishedRequest, LoRASnapshot
from appliance.telemetry.metrics import AdapterLabels, BuildInfo, Metrics
from tests.telemetry.helpers import Scrape, promtool_check_metrics


def make(max_labels: int = 32, lora: bool = True) -> Metrics:
    return Metrics(MetricsConfig(max_adapter_labels=max_labels), BuildInfo("9.9", "m", "torch"),
                   eviction_policy="fifo", lora_enabled=lora)


def page(m: Metrics) -> Scrape:
    return Scrape(m.exposition().decode())


def test_adapter_labels_are_bounded_and_never_ambiguous() -> None:
    lab = AdapterLabels(2)
    assert lab(None) == "base"
    assert [lab(n) for n in ["a", "b", "c", "a", "b", "c"]] == ["a", "b", "other", "a", "b", "other"]
    assert lab("base") == "other" and lab("other") == "other"  # adapters named like the reserved values
    assert lab.values == ["a", "b"]
    assert AdapterLabels(0)("a") == "other"


def test_events_map_onto_collectors_with_bounded_labels() -> None:
    m = make(max_labels=1)
    ev = EngineEvents(prompt_tokens=7, generation_tokens=5, preemptions=2,
                      queue_times=[("a", 0.01), ("b", 0.02), (None, 0.0)],
                      ttfts=[("a", 0.1), ("b", 0.2)], itls=[("a", 0.03)] * 4,
                      finished=[FinishedRequest("a", "stop", 0.5), FinishedRequest("b", "length", 0.6),
                                FinishedRequest(None, "abort", 0.1)],
                      slot_waits=[0.0, 1.5], loads=[AdapterLoad("cpu", True, 0.01), AdapterLoad("gpu", False, 0.002)],
                      evictions=[("gpu", "fifo"), ("cpu", "lru")],
                      prefix_cache_lookups=[(None, 40, 32), ("a", 20, 0), ("b", 50, 48), ("a", 20, 16)],
                      prefix_cache_evictions=3,
                      steps=[("graph", 8), ("piecewise", 300), ("eager", 600), ("eager", 1500), ("graph", 3)])
    m.record_events(ev)
    s = page(m)
    assert s.label_values("adapter") == {"base", "a", "other"}  # "b" is beyond the bound
    assert s.get("appliance_time_to_first_token_seconds_count", adapter="other") == 1
    assert s.get("appliance_inter_token_latency_seconds_count", adapter="a") == 4
    assert s.get("appliance_requests_total", adapter="other", finish_reason="length") == 1
    assert s.get("appliance_requests_total", adapter="base", finish_reason="abort") == 1
    assert s.get("appliance_prompt_tokens_total") == 7 and s.get("appliance_generation_tokens_total") == 5
    assert s.get("appliance_preemptions_total") == 2
    assert s.get("appliance_lora_slot_wait_seconds_count") == 2
    assert s.get("appliance_lora_slot_wait_seconds_sum") == 1.5
    assert s.get("appliance_lora_loads_total", tier="gpu", result="error") == 1
    assert s.get("appliance_lora_evictions_total", tier="gpu", policy="fifo") == 1
    assert (s.get("appliance_prefix_cache_queries_total", adapter="a"),
            s.get("appliance_prefix_cache_hits_total", adapter="a")) == (40, 16)
    assert s.get("appliance_prefix_cache_hits_total", adapter="other") == 48
    assert s.get("appliance_prefix_cache_queries_total", adapter="base") == 40
    assert s.get("appliance_prefix_cache_evictions_total") == 3
    assert [s.get("appliance_engine_steps_total", path=p) for p in ("graph", "piecewise", "eager")] == [2, 1, 2]
    assert s.get("appliance_engine_step_tokens_bucket", path="eager", le="512.0") == 0  # none fit a piecewise graph
    assert s.get("appliance_engine_step_tokens_bucket", path="eager", le="1024.0") == 1
    assert s.get("appliance_engine_step_tokens_sum", path="graph") == 11
    assert promtool_check_metrics(s.text).returncode == 0


def test_snapshot_sets_gauges_and_lora_off_reads_zero() -> None:
    m = make()
    m.record_snapshot(EngineSnapshot(running=3, waiting={"slot": 2, "kv": 1, "budget": 0, "load": 4},
                                     kv_usage=0.25, lora=LoRASnapshot(4, 3, 1, 3, 2, 6, reads_in_flight=5,
                                                                      copies_in_flight=1),
                                     prefix_cache_blocks=9))
    s = page(m)
    assert s.get("appliance_prefix_cache_blocks") == 9
    assert s.get("appliance_requests_running") == 3
    assert s.get("appliance_requests_waiting", reason="slot") == 2
    assert s.get("appliance_requests_waiting", reason="load") == 4
    assert (s.get("appliance_lora_loads_in_flight", tier="cpu"),
            s.get("appliance_lora_loads_in_flight", tier="gpu")) == (5, 1)
    assert s.get("appliance_kv_cache_usage_ratio") == 0.25
    assert (s.get("appliance_lora_slots"), s.get("appliance_lora_slots_used"),
            s.get("appliance_lora_slots_pinned")) == (4, 3, 1)
    assert s.get("appliance_lora_adapters", tier="registered") == 6
    m.record_snapshot(EngineSnapshot(running=0, waiting={}, kv_usage=0.0, lora=None))
    s = page(m)
    assert s.get("appliance_lora_slots") == 0 and s.get("appliance_requests_waiting", reason="slot") == 0


def test_reconcile_api_counts_and_refuses_unknown_values() -> None:
    m = make()
    m.record_reconcile("failed", 0.5, [("load", "success"), ("pin", "success"), ("unload", "failed")])
    m.record_reconcile("unchanged", 0.01)
    before = m.exposition()
    for bad in [lambda: m.record_reconcile("great", 1.0),
                lambda: m.record_reconcile("success", 1.0, [("explode", "success")]),
                lambda: m.record_reconcile("success", 1.0, [("load", "maybe")]),
                lambda: m.record_reconcile("success", -1.0),
                lambda: m.record_config_reload(True, 0, 1.0)]:
        with pytest.raises(ValueError):
            bad()
    assert m.exposition() == before  # a refused call counted nothing
    s = page(m)
    assert s.get("appliance_reconcile_total", result="failed") == 1
    assert s.get("appliance_reconcile_total", result="unchanged") == 1
    assert s.get("appliance_reconcile_total", result="success") == 0
    assert s.get("appliance_reconcile_duration_seconds_count") == 2
    assert s.get("appliance_reconcile_actions_total", action="unload", result="failed") == 1
    assert s.get("appliance_reconcile_actions_total", action="load", result="success") == 1


def test_config_reload_gauges_start_at_generation_one_and_track_reloads() -> None:
    m = make()
    s = page(m)
    assert s.get("appliance_config_generation") == 1 and s.get("appliance_config_last_reload_successful") == 1
    t0 = s.get("appliance_config_last_reload_success_timestamp_seconds")
    m.record_config_reload(True, 2, t0 + 10)
    m.record_config_reload(False, 2, t0 + 20)  # a failed reload keeps the generation and the last success
    s = page(m)
    assert s.get("appliance_config_generation") == 2
    assert s.get("appliance_config_last_reload_successful") == 0
    assert s.get("appliance_config_last_reload_success_timestamp_seconds") == t0 + 10


def test_two_instances_do_not_share_series() -> None:
    a, b = make(), make()
    a.record_events(EngineEvents(generation_tokens=3))
    assert page(a).get("appliance_generation_tokens_total") == 3
    assert page(b).get("appliance_generation_tokens_total") == 0


def test_metrics_config_checks() -> None:
    from appliance.config.schema import ConfigError
    from tests.conftest import default_config

    with pytest.raises(ConfigError, match="metrics.max_adapter_labels"):
        default_config("metrics.max_adapter_labels=-1")
    with pytest.raises(ConfigError, match="metrics.require_key"):
        default_config("metrics.require_key=true")
    assert default_config("metrics.require_key=true", "server.api_keys=[k]").metrics.require_key
