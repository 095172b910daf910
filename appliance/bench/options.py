"""What `appliance bench` runs: its modes and options, with their checks.

Apart from the bench itself (appliance/bench/suite.py) so that building the CLI's argument parser, which
every `appliance` command does, imports no torch: `appliance validate`, `plan` and `apply` start in a
second instead of five.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from appliance.config.schema import LORA_TARGETS, ConfigError
from appliance.engine.request import MAX_LOGPROBS

MODES = ("offline", "online", "all")
# --online-overlap: the config's lora.overlap_loading, forced off or on, or one run of each: "both" = off
# first, "on-off" = on first; "off-on-on-off" / "on-off-off-on" run both orders in one process. Runs
# share the process, so whatever the first run leaves warm (kernels compiled for a batch layout when
# engine.warmup is off, the page cache of the adapter files) favours the later ones: compare both
# orders before crediting either setting.
OVERLAP_CHOICES = {"config": (None,), "off": (False,), "on": (True,), "both": (False, True),
                   "on-off": (True, False), "off-on-on-off": (False, True, True, False),
                   "on-off-off-on": (True, False, False, True)}
# --online-single: after which online runs the same arrivals run again all on one adapter (the Zipf
# head), on the same engine: the "p99 TTFT <= 3x the same load with a single adapter".
SINGLE_CHOICES = ("each", "first", "none")


@dataclass
class BenchOptions:
    mode: str = "all"
    out: str = "bench-results"  # directory for bench.json and the PNGs
    # Offline throughput: `batch` requests (or D when more) at once, request i on adapter i % D.
    batch: int = 64
    prompt_len: int = 128
    new_tokens: int = 64
    adapters: list[int] = field(default_factory=lambda: [0, 1, 8, 64, 256])
    ranks: list[int] = field(default_factory=lambda: [16])
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # Decode step against its memory floor (0 steps = skip); with and without distinct adapters.
    decode_batch: int = 64
    decode_context: int = 1024
    decode_steps: int = 16
    decode_adapters: int = 64
    profile_decode: bool = False  # torch.profiler over 2 extra decode steps: top kernels into the JSON
    decode_logprobs: Optional[int] = None  # also time the decode steps with logprobs=K on every row
    # A built-in schema name (bench/schemas.py) or a JSON schema file: each decode row runs again with it
    # on every sequence (structured outputs), beside the unconstrained one.
    decode_json_schema: Optional[str] = None
    # Prefill tokens/s, base and with distinct adapters (0 requests = skip).
    prefill_requests: int = 32
    prefill_len: int = 512
    prefill_adapters: int = 16
    # The same workload through transformers and peft (and the engine), where importable.
    baseline_batch: int = 32
    baseline_adapters: int = 32
    baseline_new_tokens: Optional[int] = None  # None = new_tokens
    # transformers / peft generate this many new tokens instead (None = baseline_new_tokens): peft's mixed
    # generate runs ~20 tok/s on an 8B shape, so a GPU call bounds it. The engine runs that count too
    # (same-workload rows), and each baseline's per-token time is extrapolated to baseline_new_tokens.
    baseline_hf_new_tokens: Optional[int] = None
    skip_baselines: bool = False  # no transformers / peft runs (the engine's rows of that workload stay)
    # Online: Poisson arrivals, Zipf(zipf) popularity over online_adapters adapters.
    online_requests: int = 256
    online_rate: float = 8.0
    online_adapters: int = 512
    zipf: float = 1.1
    online_overlap: str = "config"  # OVERLAP_CHOICES: "both" runs the workload with overlap loading off, then on
    online_single: str = "each"  # SINGLE_CHOICES: the same arrivals on one adapter after each / the first run
    adapter_dir: Optional[str] = None  # where synthetic adapters go (default: a temp dir, removed after)
    seed: int = 0
    budget_s: Optional[float] = None  # skip phases not started by then
    keep_going: bool = False  # record a failing phase's error and go on (exit status 1 at the end)
    progress: bool = True

    def check(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"bench mode {self.mode!r} is not one of {', '.join(MODES)}")
        for k in ("batch", "prompt_len", "new_tokens", "baseline_batch", "decode_batch", "decode_context"):
            if getattr(self, k) < 1:
                raise ConfigError(f"bench --{k.replace('_', '-')}: must be >= 1, got {getattr(self, k)}")
        if any(r < 1 for r in self.ranks) or not self.ranks:
            raise ConfigError(f"bench --ranks: must be >= 1, got {self.ranks}")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise ConfigError(f"bench --targets: {bad or '[]'} not in {', '.join(LORA_TARGETS)}")
        if self.online_overlap not in OVERLAP_CHOICES:
            raise ConfigError(f"bench --online-overlap: {self.online_overlap!r} is not one of "
                              f"{', '.join(OVERLAP_CHOICES)}")
        if self.online_single not in SINGLE_CHOICES:
            raise ConfigError(f"bench --online-single: {self.online_single!r} is not one of "
                              f"{', '.join(SINGLE_CHOICES)}")
        if self.baseline_hf_new_tokens is not None and self.baseline_hf_new_tokens < 2:
            raise ConfigError(f"bench --baseline-hf-new-tokens: must be >= 2 (a per-token time needs two "
                              f"lengths), got {self.baseline_hf_new_tokens}")
        if self.decode_logprobs is not None and not 0 <= self.decode_logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"bench --decode-logprobs: must be in 0..{MAX_LOGPROBS}, got {self.decode_logprobs}")
        if self.decode_json_schema is not None:
            from appliance.bench.schemas import load_schema

            try:
                load_schema(self.decode_json_schema)
            except ValueError as e:
                raise ConfigError(f"bench --decode-json-schema: {e}") from None
        if any(d < 0 for d in self.adapters):
            raise ConfigError(f"bench --adapters: counts must be >= 0, got {self.adapters}")

    @property
    def main_rank(self) -> int:
        return 16 if 16 in self.ranks else self.ranks[0]

    @property
    def baseline_tokens(self) -> int:
        return self.baseline_new_tokens or self.new_tokens

    @property
    def hf_tokens(self) -> int:
        return self.baseline_hf_new_tokens or self.baseline_tokens
