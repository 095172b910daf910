"""What `appliance bench serve` runs: its options and their checks. Torch-free, like options.py: the CLI
builds its parser from here without importing the engine.

Rows of the report: every adapter mix (`mixes`) crossed with every load point, closed loop at each of
`concurrency` and Poisson arrivals at each of `rate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from appliance.config.schema import LORA_TARGETS, ConfigError

APIS = ("auto", "chat", "completions", "generate")
# base: no adapter; uniform / zipf: each request draws one of the adapters (uniformly, or with
# P(k) ∝ 1/(k+1)^s); one: every request on the first adapter.
MIXES = ("base", "uniform", "zipf", "one")
LENGTH_DISTS = ("fixed", "uniform", "lognormal")
# The environment variables the keys come from (never a flag: a flag shows up in `ps` and shell history).
API_KEY_ENV = "APPLIANCE_API_KEY"
ADMIN_KEY_ENV = "APPLIANCE_ADMIN_KEY"


@dataclass
class ServeOptions:
    out: str = "bench-results"  # directory for serve.json, the PNGs and server.log
    url: Optional[str] = None  # an existing server; None = start one from the config
    api: str = "auto"  # APIS; auto = chat with a chat template, completions with a tokenizer, else generate
    concurrency: list[int] = field(default_factory=lambda: [8])  # closed-loop load points
    rate: list[float] = field(default_factory=list)  # Poisson load points, requests/s
    num_requests: int = 64  # measured requests per row
    warmup_requests: Optional[int] = None  # per row, not measured; None = one wave (the concurrency, <= 16 for rates)
    seed: int = 0
    mixes: list[str] = field(default_factory=lambda: ["base"])
    adapters: int = 0  # synthetic adapters made and loaded through the admin API
    config_adapters: bool = False  # the mixes run over the config's declared adapters instead
    rank: int = 16
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    zipf: float = 1.1
    adapter_dir: Optional[str] = None  # where synthetic adapters go (default: a temp dir, removed after)
    prompt_len: int = 128
    prompt_dist: str = "fixed"
    # Tokens of a fixed random prefix before each prompt, one per adapter (the base model has its own):
    # a system prompt shared by every chat of an application, what prefix caching saves. 0 = none.
    shared_prefix_len: int = 0
    output_len: int = 128
    output_dist: str = "fixed"
    range_ratio: float = 0.5  # uniform: lengths in [len·(1-r), len·(1+r)]
    compare_in_process: Optional[bool] = None  # None = on when the bench starts the server
    server_timeout_s: float = 900.0  # model load, graph capture and warm-up of a started server
    request_timeout_s: float = 3600.0  # one request, client side
    progress: bool = True
    # HTTP client processes; 0 = one per two cores, at most 8 (one Python thread streams a few thousand
    # events a second: on a GPU server a single client would be the bottleneck).
    client_procs: int = 0
    # Cold-adapter mix (serve_cold.py): every row again, with this many requests that each name an adapter
    # the server has not loaded and resolves from cold_source (lora.resolver) while the row runs; the
    # regular rows send as many to loaded adapters at the same times (the same run without loads); 0 = off.
    cold_adapters: int = 0
    cold_source: str = "moto"  # moto (a local S3 API server the bench starts) or s3://BUCKET/PREFIX/{name}
    cold_start_s: float = 1.0  # the first extra (cold or warm) request, this long into the row's measured requests
    cold_interval_s: float = 0.5  # between extra requests
    cold_output_len: int = 16  # output tokens of an extra request
    # The two-tenant fairness mix (serve_tenants.py, docs/tenants.md) instead of the load rows: each
    # tenant's share in requests/s, which tenant B offers steadily; 0 = off.
    tenant_rate: float = 0.0
    tenant_flood: float = 10.0  # what tenant A offers, in multiples of its share

    def client_processes(self) -> int:
        if self.client_procs:
            return self.client_procs
        import os

        return max(1, min(8, (os.cpu_count() or 2) // 2))

    def check(self) -> None:
        if self.api not in APIS:
            raise ConfigError(f"bench serve --api: {self.api!r} is not one of {', '.join(APIS)}")
        if self.tenant_rate:
            self._check_tenant_mix()
        elif not self.concurrency and not self.rate:
            raise ConfigError("bench serve: give at least one load point (--concurrency or --rate)")
        if self.client_procs < 0:
            raise ConfigError(f"bench serve --client-procs: must be >= 0 (0 = automatic), got {self.client_procs}")
        if any(c < 1 for c in self.concurrency):
            raise ConfigError(f"bench serve --concurrency: each must be >= 1, got {self.concurrency}")
        if any(not r > 0 for r in self.rate):
            raise ConfigError(f"bench serve --rate: each must be > 0 requests/s, got {self.rate}")
        for k in ("num_requests", "prompt_len", "output_len", "rank"):
            if getattr(self, k) < 1:
                raise ConfigError(f"bench serve --{k.replace('_', '-')}: must be >= 1, got {getattr(self, k)}")
        if self.shared_prefix_len < 0:
            raise ConfigError(f"bench serve --shared-prefix-len: must be >= 0, got {self.shared_prefix_len}")
        if self.warmup_requests is not None and self.warmup_requests < 0:
            raise ConfigError(f"bench serve --warmup-requests: must be >= 0, got {self.warmup_requests}")
        if self.adapters < 0:
            raise ConfigError(f"bench serve --adapters: must be >= 0, got {self.adapters}")
        if self.config_adapters and self.adapters:
            raise ConfigError("bench serve: --adapters N (synthetic) and --config-adapters exclude each other")
        bad = [m for m in self.mixes if m not in MIXES]
        if bad or not self.mixes:
            raise ConfigError(f"bench serve --mix: {bad or '[]'} not in {', '.join(MIXES)}")
        if any(m != "base" for m in self.mixes) and not (self.adapters or self.config_adapters):
            raise ConfigError(f"bench serve --mix {','.join(self.mixes)}: adapter mixes need adapters: "
                              "--adapters N (synthetic) or --config-adapters")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise ConfigError(f"bench serve --targets: {bad or '[]'} not in {', '.join(LORA_TARGETS)}")
        for k in ("prompt_dist", "output_dist"):
            if getattr(self, k) not in LENGTH_DISTS:
                raise ConfigError(f"bench serve --{k.replace('_', '-')}: {getattr(self, k)!r} is not one of "
                                  f"{', '.join(LENGTH_DISTS)}")
        if not 0 <= self.range_ratio < 1:
            raise ConfigError(f"bench serve --range-ratio: must be in [0, 1), got {self.range_ratio}")
        if self.zipf <= 0:
            raise ConfigError(f"bench serve --zipf: must be > 0, got {self.zipf}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"bench serve --url: expected http://host:port, got {self.url!r}")
        from appliance.bench.serve_cold import check_cold_options

        check_cold_options(self)

    def _check_tenant_mix(self) -> None:
        if self.tenant_rate < 0:
            raise ConfigError(f"bench serve --tenant-rate: must be > 0 requests/s, got {self.tenant_rate}")
        if self.concurrency or self.rate:
            raise ConfigError("bench serve --tenant-rate runs the two-tenant mix instead of the load rows: "
                              "drop --concurrency / --rate")
        if self.cold_adapters:
            raise ConfigError("bench serve --tenant-rate and --cold-adapters are two separate mixes: run one at a time")
        if self.url is not None:
            raise ConfigError("bench serve --tenant-rate: the mix writes the tenants config of the server it "
                              "starts, so it cannot use --url")
        if not self.tenant_flood > 1:
            raise ConfigError(f"bench serve --tenant-flood: must be > 1 (tenant A offers more than its share), "
                              f"got {self.tenant_flood}")

    @property
    def in_process(self) -> bool:
        return self.url is None if self.compare_in_process is None else self.compare_in_process


def int_list(s: str) -> list[int]:
    """'8,64,256' -> [8, 64, 256] (argparse type)."""
    return [int(x) for x in s.split(",") if x.strip()]


def float_list(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def str_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]
