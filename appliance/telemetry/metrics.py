"""Every Prometheus collector of the appliance, and the mapping of engine stats onto them.

The engine emits plain stats (telemetry/stats.py): events after every loop iteration (`record_events`,
called on the engine thread) and a snapshot of its state at each scrape (`record_snapshot`). The
reconciler reports through `record_reconcile` and `record_config_reload`. Nothing else writes here.

Names follow Prometheus' conventions: prefix `appliance_`, base units (seconds, ratios 0..1),
counters end in `_total`. Each `Metrics` owns its own CollectorRegistry (not the process-global one),
so several servers in one process (the tests) never share or clash. With tensor parallelism only the
scheduler process (rank 0) builds a server and so exports; workers report nothing.

The `adapter` label takes values only from the engine's events, which carry registered adapter names:
a request for an unknown model is refused before the engine sees it, so client input never creates a
series. At most `metrics.max_adapter_labels` adapter names get their own value (first seen, first
served); later ones share "other". The base model is "base". An adapter literally named "base" or
"other" is reported as "other", so that neither value is ambiguous.

`appliance_lora_adapter_resident` names adapters by their registered name (config or admin API), one
series per adapter in memory, so it is bounded by the tiers (lora.max_loaded_loras and the slots), not
by max_adapter_labels. `appliance_http_requests_total` labels by route template (never the raw path;
"unmatched" for a path no route serves) and status code. With metrics.gateway_compat the vLLM-named
metrics of telemetry/gateway.py join the same registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from appliance.config.schema import MetricsConfig
from appliance.telemetry.gateway import GatewayMetrics
from appliance.telemetry.stats import STEP_PATHS, WAIT_REASONS, EngineEvents, EngineSnapshot

# The classic text format. Every name here is a legacy (ASCII) name, for which generate_latest's output
# is exactly format 0.0.4, the version every Prometheus (Debian's 2.42 included) knows by this header.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

BASE_LABEL = "base"
OTHER_LABEL = "other"

# Buckets in seconds. TTFT spans a warm GPU prefill (ms) to a long prompt queued on a busy CPU
# (minutes); vLLM's TTFT buckets were the starting point.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# One decode step: a few ms on a GPU, tens to hundreds of ms on a CPU, more when a load stalls steps.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                 160.0, 320.0, 640.0)
# Reading a PEFT dir (ms to seconds for big all-linear adapters); copying into a slot (sub-ms to 100s ms).
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0)
# Scheduled tokens of a step: the decode batch sizes and engine.piecewise_graph_tokens' sizes (up to 512)
# and beyond, up to engine.max_num_batched_tokens' range, so eager steps show how large they ran.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RECONCILE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Label values the reconciler may report (anything else is a bug: ValueError, never a new series). The
# results are ReconcileRecord.result's (reconcile/controller.py): success, failed (an action failed),
# invalid (the config did not compose or validate), unchanged (nothing to do).
RECONCILE_RESULTS = ("success", "failed", "invalid", "unchanged")
RECONCILE_ACTIONS = ("load", "unload", "reload", "pin", "unpin")
ACTION_RESULTS = ("success", "failed")
# error: the engine failed the request (a failed step or adapter load; docs/reliability.md).
FINISH_REASONS = ("stop", "length", "abort", "error")

# `_created` series double every counter's and histogram's series and no dashboard reads them. The
# switch is process-wide in prometheus_client; every Metrics wants it off, so this is set once here.
prometheus_client.disable_created_metrics()


class AdapterLabels:
    """Adapter name (None = base model) -> `adapter` label value, bounded as the module doc says."""

    def __init__(self, max_labels: int) -> None:
        self.max_labels = max_labels
        self._own: set[str] = set()

    def __call__(self, name: Optional[str]) -> str:
        if name is None:
            return BASE_LABEL
        if name in self._own:
            return name
        if name in (BASE_LABEL, OTHER_LABEL) or len(self._own) >= self.max_labels:
            return OTHER_LABEL
        self._own.add(name)
        return name

    @property
    def values(self) -> list[str]:
        return sorted(self._own)


@dataclass(frozen=True)
class BuildInfo:
    version: str
    model: str  # model.name, as clients see it
    backend: str  # lora.backend


class Metrics:
    """The registry and its collectors. Thread-safe as prometheus_client is: the engine thread records
    events while the server's event loop renders a scrape."""

    def __init__(self, cfg: MetricsConfig, build: BuildInfo, eviction_policy: str,
                 lora_enabled: bool, lora_slots: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = AdapterLabels(cfg.max_adapter_labels)
        self.eviction_policy = eviction_policy
        r = self.registry

        # --- LoRA tiers
        self.lora_slots = Gauge("appliance_lora_slots", "GPU LoRA slots configured "
                                "(lora.max_loras_per_batch; 0 when LoRA is off).", registry=r)
        self.lora_slots_used = Gauge("appliance_lora_slots_used", "GPU LoRA slots holding adapter weights "
                                     "(weights of unloaded adapters that requests still use included).",
                                     registry=r)
        self.lora_slots_pinned = Gauge("appliance_lora_slots_pinned", "GPU LoRA slots held by pinned "
                                       "adapters.", registry=r)
        self.lora_adapters = Gauge("appliance_lora_adapters", "Loaded adapters by tier: gpu (in a slot), "
                                   "cpu (in host memory, no slot), disk (on disk only), remote (disk-cache "
                                   "entry evicted), registered (all, any tier).", ["tier"],
                                   registry=r)
        self.lora_evictions = Counter("appliance_lora_evictions", "Adapters evicted to make room: tier gpu "
                                      "(a slot, by lora.eviction_policy) or cpu (host memory, lru).",
                                      ["tier", "policy"], registry=r)
        self.lora_loads = Counter("appliance_lora_loads", "Adapter weight loads: tier disk (remote store to "
                                  "the disk cache), cpu (disk to host memory) or gpu (host memory to a slot); "
                                  "result success or error.",
                                  ["tier", "result"], registry=r)
        self.lora_load_duration = Histogram("appliance_lora_load_duration_seconds", "Duration of adapter "
                                            "weight loads (tier disk: remote to disk cache, cpu: disk to host, "
                                            "gpu: host to slot).",
                                            ["tier"], buckets=LOAD_BUCKETS, registry=r)
        self.lora_loads_in_flight = Gauge("appliance_lora_loads_in_flight", "lora.overlap_loading: adapter "
                                          "loads under way beside the running batch: tier cpu (disk reads "
                                          "queued or running), gpu (host-to-slot copies not yet completed).",
                                          ["tier"], registry=r)
        self.lora_slot_wait = Histogram("appliance_lora_slot_wait_seconds", "Time an adapter request "
                                        "waited for its adapter's GPU slot, per admission (0 = it had one).",
                                        buckets=QUEUE_BUCKETS, registry=r)

        # --- latency, per adapter
        self.ttft = Histogram("appliance_time_to_first_token_seconds", "Arrival to first generated token.",
                              ["adapter"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("appliance_inter_token_latency_seconds", "Time between two consecutive "
                             "tokens of a request.", ["adapter"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("appliance_e2e_request_latency_seconds", "Arrival to finish (or abort) of a "
                             "request.", ["adapter"], buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("appliance_request_queue_time_seconds", "Arrival to first scheduled "
                                    "step of a request.", ["adapter"], buckets=QUEUE_BUCKETS, registry=r)

        # --- engine
        self.running = Gauge("appliance_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("appliance_requests_waiting", "Waiting requests by what holds them: slot "
                             "(their adapter's GPU slot), kv (KV cache blocks), budget (the step's token "
                             "or sequence budget), load (their adapter's weights are being read or copied, "
                             "lora.overlap_loading).", ["reason"], registry=r)
        self.kv_usage = Gauge("appliance_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).",
                              registry=r)
        self.prompt_tokens = Counter("appliance_prompt_tokens", "Prompt tokens of requests that produced "
                                     "a first token.", registry=r)
        self.prompt_tokens_computed = Counter(
            "appliance_prompt_tokens_computed", "Prompt tokens run through the model (prefill): a "
            "preempted prompt counts again, a prompt shared by parallel samples (n) once.", registry=r)
        self.generation_tokens = Counter("appliance_generation_tokens", "Completion tokens generated.",
                                         registry=r)
        self.requests = Counter("appliance_requests", "Finished requests by adapter and finish reason "
                                "(stop, length, abort, error).", ["adapter", "finish_reason"], registry=r)
        self.preemptions = Counter("appliance_preemptions", "Running requests preempted because the KV "
                                   "cache ran out (recomputed later).", registry=r)
        self.steps = Counter("appliance_engine_steps", "Model steps by how they ran: graph (decode-only over "
                             "the static decode buffers: a CUDA graph replay on cuda, the same buffers "
                             "uncaptured elsewhere), piecewise (prefills up to the largest "
                             "engine.piecewise_graph_tokens size), eager (anything else).", ["path"], registry=r)
        self.step_tokens = Histogram("appliance_engine_step_tokens", "Scheduled tokens of a model step (real "
                                     "rows, not padding), by path.", ["path"], buckets=STEP_TOKEN_BUCKETS,
                                     registry=r)
        # --- prefix caching (engine.enable_prefix_caching)
        self.prefix_cache_queries = Counter("appliance_prefix_cache_queries", "Tokens of admitted requests "
                                            "looked up in the prefix cache (prompt, or prompt + output "
                                            "after a preemption).", ["adapter"], registry=r)
        self.prefix_cache_hits = Counter("appliance_prefix_cache_hits", "Of those tokens, the ones found "
                                         "cached (their KV reused, not computed).", ["adapter"], registry=r)
        self.prefix_cache_blocks = Gauge("appliance_prefix_cache_blocks", "KV blocks holding a cached "
                                         "prefix, held by requests or idle (idle ones are reused LRU when "
                                         "blocks run out).", registry=r)
        self.prefix_cache_evictions = Counter("appliance_prefix_cache_evictions", "Idle cached KV blocks "
                                              "evicted to hold other tokens.", registry=r)

        # --- config and reconcile (fed by the reconciler)
        self.reconcile = Counter("appliance_reconcile", "Reconcile runs by result (success, failed, invalid, "
                                 "unchanged).", ["result"], registry=r)
        self.reconcile_duration = Histogram("appliance_reconcile_duration_seconds", "Duration of a reconcile "
                                            "run.", buckets=RECONCILE_BUCKETS, registry=r)
        self.reconcile_actions = Counter("appliance_reconcile_actions", "Reconcile actions applied by action "
                                         "and result.", ["action", "result"], registry=r)
        self.config_reload_ok = Gauge("appliance_config_last_reload_successful", "1 when the last config "
                                      "(re)load succeeded, else 0.", registry=r)
        self.config_reload_ts = Gauge("appliance_config_last_reload_success_timestamp_seconds", "Unix time "
                                      "of the last successful config (re)load.", registry=r)
        self.config_generation = Gauge("appliance_config_generation", "Generation of the live config "
                                       "(1 = the one the server started with, +1 per applied change).",
                                       registry=r)
        self.build_info = Gauge("appliance_build_info", "Always 1; the labels say what runs.",
                                ["version", "model", "backend"], registry=r)

        # --- HTTP and adapter residency
        self.http_requests = Counter("appliance_http_requests", "HTTP requests answered, by route template "
                                     "(unmatched: no route) and status code.", ["route", "code"], registry=r)
        self.lora_resident = Gauge("appliance_lora_adapter_resident", "1 per adapter whose weights are in "
                                   "memory: tier gpu (a slot) or cpu (host memory), pinned, its rank.",
                                   ["adapter", "tier", "pinned", "rank"], registry=r)
        self.gateway = (GatewayMetrics(r, build.model, lora_slots if lora_enabled else 0, time.time)
                        if cfg.gateway_compat else None)

        self._initial_series(build, lora_enabled)

    def _initial_series(self, build: BuildInfo, lora_enabled: bool) -> None:
        """Series with fixed label sets start at 0, so rates and dashboards have data from the start."""
        self.build_info.labels(build.version, build.model, build.backend).set(1)
        for reason in WAIT_REASONS:
            self.waiting.labels(reason)
        for tier in ("gpu", "cpu", "disk", "remote", "registered"):
            self.lora_adapters.labels(tier)
        if lora_enabled:
            self.lora_evictions.labels("gpu", self.eviction_policy)
            self.lora_evictions.labels("cpu", "lru")
            for tier in ("cpu", "gpu"):
                self.lora_loads_in_flight.labels(tier)
            for tier in ("disk", "cpu", "gpu"):
                self.lora_load_duration.labels(tier)
                for result in ("success", "error"):
                    self.lora_loads.labels(tier, result)
        for reason in FINISH_REASONS:
            self.requests.labels(BASE_LABEL, reason)
        for path in STEP_PATHS:
            self.steps.labels(path)
            self.step_tokens.labels(path)
        for h in (self.ttft, self.itl, self.e2e, self.queue_time):
            h.labels(BASE_LABEL)
        self.prefix_cache_queries.labels(BASE_LABEL)
        self.prefix_cache_hits.labels(BASE_LABEL)
        for result in RECONCILE_RESULTS:
            self.reconcile.labels(result)
        for action in RECONCILE_ACTIONS:
            for result in ACTION_RESULTS:
                self.reconcile_actions.labels(action, result)
        # The startup config is generation 1, loaded successfully (the server would not run otherwise).
        self.record_config_reload(True, 1, time.time())

    # ------------------------------------------------------------------ engine
    def record_events(self, ev: EngineEvents) -> None:
        label = self.labels
        self.prompt_tokens.inc(ev.prompt_tokens)
        self.prompt_tokens_computed.inc(ev.prompt_tokens_computed)
        self.generation_tokens.inc(ev.generation_tokens)
        self.preemptions.inc(ev.preemptions)
        for adapter, s in ev.queue_times:
            self.queue_time.labels(label(adapter)).observe(s)
        for adapter, s in ev.ttfts:
            self.ttft.labels(label(adapter)).observe(s)
        for adapter, s in ev.itls:
            self.itl.labels(label(adapter)).observe(s)
        for f in ev.finished:
            a = label(f.adapter)
            self.e2e.labels(a).observe(f.e2e_s)
            self.requests.labels(a, f.finish_reason).inc()
        for s in ev.slot_waits:
            self.lora_slot_wait.observe(s)
        for load in ev.loads:
            self.lora_loads.labels(load.tier, "success" if load.ok else "error").inc()
            self.lora_load_duration.labels(load.tier).observe(load.duration_s)
        for tier, policy in ev.evictions:
            self.lora_evictions.labels(tier, policy).inc()
        for adapter, queried, hit in ev.prefix_cache_lookups:
            a = label(adapter)
            self.prefix_cache_queries.labels(a).inc(queried)
            self.prefix_cache_hits.labels(a).inc(hit)
        self.prefix_cache_evictions.inc(ev.prefix_cache_evictions)
        for path, tokens in ev.steps:
            self.steps.labels(path).inc()
            self.step_tokens.labels(path).observe(tokens)

    def record_snapshot(self, snap: EngineSnapshot) -> None:
        self.running.set(snap.running)
        for reason in WAIT_REASONS:
            self.waiting.labels(reason).set(snap.waiting.get(reason, 0))
        self.kv_usage.set(snap.kv_usage)
        self.prefix_cache_blocks.set(snap.prefix_cache_blocks)
        lora = snap.lora
        self.lora_slots.set(lora.slots if lora else 0)
        self.lora_slots_used.set(lora.slots_used if lora else 0)
        self.lora_slots_pinned.set(lora.slots_pinned if lora else 0)
        self.lora_adapters.labels("gpu").set(lora.adapters_gpu if lora else 0)
        self.lora_adapters.labels("cpu").set(lora.adapters_cpu if lora else 0)
        self.lora_adapters.labels("registered").set(lora.adapters_registered if lora else 0)
        self.lora_adapters.labels("disk").set(lora.adapters_disk if lora else 0)
        self.lora_adapters.labels("remote").set(lora.adapters_remote if lora else 0)
        if lora is not None:
            self.lora_loads_in_flight.labels("cpu").set(lora.reads_in_flight)
            self.lora_loads_in_flight.labels("gpu").set(lora.copies_in_flight)
        # Rebuilt each scrape: an evicted or unloaded adapter's series goes away.
        self.lora_resident.clear()
        for a in lora.resident if lora else ():
            self.lora_resident.labels(a.name, a.tier, str(a.pinned).lower(), str(a.rank)).set(1)
        if self.gateway is not None:
            self.gateway.record_snapshot(snap)

    # ------------------------------------------------------------------ HTTP
    def record_http(self, route: str, code: int) -> None:
        """One answered request: `route` a route template or "unmatched", never a raw path."""
        self.http_requests.labels(route, str(code)).inc()

    # ------------------------------------------------------------------ reconciler API
    def record_reconcile(self, result: str, duration_s: float,
                         actions: Sequence[tuple[str, str]] = ()) -> None:
        """One reconcile run: its result (RECONCILE_RESULTS), how long it took, and each action it
        applied as (action, result) with action in RECONCILE_ACTIONS and result in ACTION_RESULTS.
        Unknown values raise ValueError before anything is counted."""
        _check("result", result, RECONCILE_RESULTS)
        for action, res in actions:
            _check("action", action, RECONCILE_ACTIONS)
            _check("action result", res, ACTION_RESULTS)
        if duration_s < 0:
            raise ValueError(f"duration_s must be >= 0, got {duration_s}")
        self.reconcile.labels(result).inc()
        self.reconcile_duration.observe(duration_s)
        for action, res in actions:
            self.reconcile_actions.labels(action, res).inc()

    def record_config_reload(self, ok: bool, generation: int, timestamp: float) -> None:
        """A config (re)load: `ok` whether it was taken, `generation` the live config's generation
        afterwards (unchanged by a failed reload), `timestamp` unix seconds of the attempt."""
        if generation < 1:
            raise ValueError(f"generation must be >= 1, got {generation}")
        self.config_reload_ok.set(1 if ok else 0)
        self.config_generation.set(generation)
        if ok:
            self.config_reload_ts.set(timestamp)

    # ------------------------------------------------------------------ exposition
    def exposition(self) -> bytes:
        """The text format (CONTENT_TYPE) of every collector."""
        return generate_latest(self.registry)


def _check(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"reconcile {what} {value!r} is not one of {', '.join(allowed)}")
