"""Per-tenant collectors (server/tenants.py), on the app's registry beside telemetry/metrics.py's.

The `tenant` label takes only names from the `tenants:` config, and NO_TENANT for requests with one
of server.api_keys or on an open server, so its cardinality is bounded by the config, never by what
clients send. No key,
digest or secret is ever a label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Requests that carry no tenant's key: server.api_keys, or an open server. Not a valid tenant name.
NO_TENANT = "(none)"
# Why a tenant's request was refused: the `reason` label of appliance_tenant_rejections_total.
REJECT_REASONS = ("concurrency", "requests_per_s", "tokens_per_min", "max_tokens")
# Seconds from admission to the first update from the engine (queue wait + prefill).
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TenantObserver:
    """What server/tenants.py reports; this no-op one when metrics are off."""

    def known(self, names: tuple[str, ...]) -> None: ...

    def rejected(self, tenant: str, reason: str) -> None: ...

    def admitted(self, tenant: str) -> None: ...

    def first_output(self, tenant: str, wait_s: float) -> None: ...

    def finished(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None: ...


class TenantMetrics(TenantObserver):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("appliance_tenant_requests", "Inference requests admitted, by tenant.",
                                ["tenant"], registry=r)
        self.tokens = Counter("appliance_tenant_tokens", "Tokens of finished requests by tenant and kind "
                              "(prompt, completion).", ["tenant", "kind"], registry=r)
        self.rejections = Counter("appliance_tenant_rejections", "Requests refused by a tenant limit, by "
                                  f"tenant and reason ({', '.join(REJECT_REASONS)}).", ["tenant", "reason"],
                                  registry=r)
        self.queue_time = Histogram("appliance_tenant_queue_time_seconds", "Admission to the first update "
                                    "from the engine (waiting in the queue, then the prefill), by tenant.",
                                    ["tenant"], buckets=WAIT_BUCKETS, registry=r)

    def known(self, names: tuple[str, ...]) -> None:
        """Show every configured tenant's series at 0 from the start (dashboards see them before traffic)."""
        for name in (*names, NO_TENANT):
            self.requests.labels(name)
            self.queue_time.labels(name)
            for kind in ("prompt", "completion"):
                self.tokens.labels(name, kind)
            for reason in REJECT_REASONS:
                self.rejections.labels(name, reason)

    def rejected(self, tenant: str, reason: str) -> None:
        self.rejections.labels(tenant, reason).inc()

    def admitted(self, tenant: str) -> None:
        self.requests.labels(tenant).inc()

    def first_output(self, tenant: str, wait_s: float) -> None:
        self.queue_time.labels(tenant).observe(wait_s)

    def finished(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.tokens.labels(tenant, "prompt").inc(prompt_tokens)
        self.tokens.labels(tenant, "completion").inc(completion_tokens)
