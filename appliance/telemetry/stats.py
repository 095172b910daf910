"""What the engine reports for metrics: events since the last take, and a snapshot of its state.

Plain dataclasses, no prometheus: the engine, scheduler and LoRA manager record events where they
happen into one `StatsRecorder` (on the engine thread). The async engine hands the events to its sink
(appliance/telemetry/metrics.py) after every loop iteration, and a scrape asks the engine thread for a fresh
`EngineSnapshot`, so gauges are read between two steps and always consistent with each other.

Adapter labels are registered adapter names (never request input): a request whose model is unknown
is refused before it reaches the engine and so never appears here. None = the base model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

# Why a waiting request is not running: its adapter has no GPU slot, the KV cache is full, the
# step's token/sequence budget (engine.max_num_batched_tokens, engine.max_num_seqs) is spent, or
# (lora.overlap_loading) its adapter's weights are still being read from disk or copied to the GPU.
WaitReason = Literal["slot", "kv", "budget", "load"]
WAIT_REASONS: tuple[WaitReason, ...] = ("slot", "kv", "budget", "load")
# LoRA tiers: "disk" = a remote store -> the disk cache (a download), "cpu" = disk -> host memory,
# "gpu" = host memory -> a GPU slot.
LoadTier = Literal["disk", "cpu", "gpu"]
# How the model runner ran a step: graph = over the static decode buffers (a CUDA graph replay on cuda,
# the same buffers run uncaptured elsewhere), piecewise = over the piecewise step's buffers (graphs
# between attentions on cuda), eager = anything else (larger steps, CPU without static buffers).
StepPath = Literal["graph", "piecewise", "eager"]
STEP_PATHS: tuple[StepPath, ...] = ("graph", "piecewise", "eager")


@dataclass(frozen=True)
class FinishedRequest:
    adapter: Optional[str]  # registered adapter name; None = base model
    finish_reason: str  # stop | length | abort
    e2e_s: float  # arrival -> finish (or abort)


@dataclass(frozen=True)
class AdapterLoad:
    tier: LoadTier
    ok: bool  # False: reading or copying the weights raised
    duration_s: float


@dataclass
class EngineEvents:
    """Everything counted since the previous `StatsRecorder.take()`."""

    prompt_tokens: int = 0  # prompt length of each request, counted once at its first token
    # Prompt tokens run through the model: a preempted prompt counts again, a shared one (n) once.
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0  # completion tokens (a stop token the engine drops is not counted)
    preemptions: int = 0
    # Prefix caching, per admission: (adapter, prompt tokens looked up, of them found cached).
    prefix_cache_lookups: list[tuple[Optional[str], int, int]] = field(default_factory=list)
    prefix_cache_evictions: int = 0  # idle cached blocks reused for other tokens
    queue_times: list[tuple[Optional[str], float]] = field(default_factory=list)  # arrival -> first scheduled
    ttfts: list[tuple[Optional[str], float]] = field(default_factory=list)  # arrival -> first token
    itls: list[tuple[Optional[str], float]] = field(default_factory=list)  # between two tokens of a request
    finished: list[FinishedRequest] = field(default_factory=list)
    slot_waits: list[float] = field(default_factory=list)  # per admission of an adapter request
    loads: list[AdapterLoad] = field(default_factory=list)
    evictions: list[tuple[LoadTier, str]] = field(default_factory=list)  # (tier, policy)
    # Per model step that ran (a failed one is not, its request-by-request reruns are): (path, scheduled tokens).
    steps: list[tuple[StepPath, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self == EngineEvents()


class StatsRecorder:
    """Collects EngineEvents on the engine thread; `take()` hands them over and starts afresh.

    Not thread-safe: only the engine thread records and takes (the async engine's loop and the scrape's
    `AsyncEngine.call` both run there).
    """

    def __init__(self) -> None:
        self.events = EngineEvents()

    def take(self) -> EngineEvents:
        out, self.events = self.events, EngineEvents()
        return out

    def load(self, tier: LoadTier, ok: bool, duration_s: float) -> None:
        self.events.loads.append(AdapterLoad(tier, ok, duration_s))

    def eviction(self, tier: LoadTier, policy: str) -> None:
        self.events.evictions.append((tier, policy))

    def step(self, path: StepPath, tokens: int) -> None:
        self.events.steps.append((path, tokens))


@dataclass(frozen=True)
class AdapterResidency:
    """One adapter whose weights are in memory: registered names only (config or admin API)."""

    name: str
    tier: LoadTier  # gpu (a slot) or cpu (host memory, no slot); adapters on disk only are left out
    pinned: bool
    rank: int


@dataclass(frozen=True)
class LoRASnapshot:
    slots: int  # lora.max_loras_per_batch
    slots_used: int  # slots holding weights, retiring weights of unloaded adapters included
    slots_pinned: int
    # Adapters by tier as /v1/adapters shows them: gpu (in a slot), cpu (host memory, no slot);
    # registered = every loaded name, whatever its tier.
    adapters_gpu: int
    adapters_cpu: int
    adapters_registered: int
    # lora.overlap_loading: background disk reads not yet taken in, side-stream copies not yet done.
    reads_in_flight: int = 0
    copies_in_flight: int = 0
    # Registered adapters whose weights are on disk only: a local dir or the disk cache (disk), or a
    # remote adapter whose disk-cache entry was evicted (remote: fetched again on its next request).
    adapters_disk: int = 0
    adapters_remote: int = 0
    # Adapters in memory, sorted by name: bounded by the tiers (lora.max_loaded_loras, the slots).
    resident: tuple[AdapterResidency, ...] = ()


@dataclass(frozen=True)
class EngineSnapshot:
    running: int
    waiting: dict[str, int]  # WaitReason -> requests
    kv_usage: float  # used KV blocks / all KV blocks, 0..1
    lora: Optional[LoRASnapshot]  # None when lora.enabled is false
    # Distinct adapter names (sorted) of the running batch's and the queue's requests.
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    prefix_cache_blocks: int = 0  # KV blocks holding a cached prefix, in use or idle (0 with caching off)
