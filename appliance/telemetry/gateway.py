"""The model-server protocol metrics the Gateway API Inference Extension's endpoint picker reads, under
vLLM's names (metrics.gateway_compat): queue length, running requests, KV usage and, with LoRA on,
`vllm:lora_requests_info`. The protocol is kubernetes-sigs/gateway-api-inference-extension's
docs/proposals/003-model-server-protocol; docs/metrics.md#gateway-compat lists what each one holds.

They live in the appliance's registry beside its own metrics and are set from the same snapshot at
each scrape, so both views agree. Adapter names in `lora_requests_info` are registered names of
requests in the engine (never client input: an unknown model is refused before the engine sees it).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Gauge

from appliance.telemetry.stats import EngineSnapshot


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_lora: int,
                 clock: Callable[[], float]) -> None:
        """`max_lora`: GPU adapter slots (lora.max_loras_per_batch); 0 = LoRA off, no lora_requests_info."""
        self.model_name = model_name
        self.max_lora = max_lora
        self.clock = clock
        r, labels = registry, ["model_name"]
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (appliance: "
                             "every waiting request, whatever holds it).", labels, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        # Both names: older endpoint pickers read the first, newer ones and vLLM >= 0.10 the second.
        self.kv_usage = [Gauge(name, "KV cache usage; 1 means 100 percent.", labels, registry=r)
                         for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")]
        self.lora_info = None
        if max_lora > 0:
            self.lora_info = Gauge("vllm:lora_requests_info", "Always one series, its value the unix time it "
                                   "was set: adapters of the running and waiting requests, and the GPU "
                                   "adapter slots.", ["running_lora_adapters", "waiting_lora_adapters",
                                                      "max_lora"], registry=r)
        self.record_snapshot(EngineSnapshot(running=0, waiting={}, kv_usage=0.0, lora=None))

    def record_snapshot(self, snap: EngineSnapshot) -> None:
        self.waiting.labels(self.model_name).set(sum(snap.waiting.values()))
        self.running.labels(self.model_name).set(snap.running)
        for g in self.kv_usage:
            g.labels(self.model_name).set(snap.kv_usage)
        if self.lora_info is not None:
            # One series at a time: the picker takes the newest value, so a stale set must not linger.
            self.lora_info.clear()
            self.lora_info.labels(",".join(snap.running_adapters), ",".join(snap.waiting_adapters),
                                  str(self.max_lora)).set(self.clock())
