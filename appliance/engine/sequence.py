"""One request's state inside the engine (plain Python; the scheduler and block manager read it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from appliance.engine.fair_share import Share
from appliance.engine.request import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # LoRA adapter key "name@generation" (None = base model); the slot is held while RUNNING.
    adapter: Optional[str] = None
    # The adapter's registered name, the label metrics use (keys change with every reload, names don't).
    adapter_name: Optional[str] = None
    output_token_ids: list[int] = field(default_factory=list)
    # One request.TokenLogprob per output token when params.logprobs is set (else stays empty).
    output_logprobs: list[Any] = field(default_factory=list)
    # When this request was first refused a LoRA slot (drives the drain rule); None = not waiting for one.
    slot_wait_since: Optional[float] = None
    # When this admission attempt was first refused a slot, drain holds included (metrics' slot wait).
    slot_refused_at: Optional[float] = None
    # Why it is still waiting after the last schedule (stats.WaitReason); None = not scheduled yet.
    wait_reason: Optional[str] = None
    status: SeqStatus = SeqStatus.WAITING
    # Tokens whose K/V are in the cache. Preemption resets it to 0 (recompute prompt + outputs).
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix caching (engine/block_manager.py): the hash chain of its full blocks so far, and how many
    # leading entries of block_table were offered to the cache (or taken from it).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_preemptions: int = 0
    first_scheduled_time: Optional[float] = None
    # When it first waited for its adapter's weights (a background read, or the slot fill of its
    # step) and when they were ready: the adapter load span of tracing (telemetry/tracing.py).
    load_wait_start: Optional[float] = None
    load_wait_end: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    finish_reason: Optional[str] = None
    # Engine-side helpers owned by the engine (detokenizer, torch.Generator); opaque to control logic.
    detok: Any = None
    generator: Any = None
    matcher: Any = None  # xgrammar GrammarMatcher of params.grammar: has accepted every output token
    text: str = ""  # all output text decoded so far (stop strings are searched here)
    sent_chars: int = 0  # how much of `text` has been handed to the caller
    sent_tokens: int = 0  # how many output tokens have been handed to the caller
    # Async scheduling: tokens sampled on the device but not yet read; they count, but have no id here.
    num_pending: int = 0
    # Its last pending token ends it by length (max_tokens or the context): it is not scheduled again.
    finishing: bool = False
    # Another sample of the same prompt (`n`): this sequence waits until that one has computed the
    # prompt's full blocks, then shares them (Scheduler._share_prompt). None once shared, or alone.
    prompt_source: Optional["Sequence"] = None
    # Whose request it is for fair admission (engine/fair_share.py; None = the no-tenant flow), and
    # its start tag there: the waiting queue is kept in tag order.
    share: Optional[Share] = None
    fair_tag: float = 0.0

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def is_pending(self, i: int) -> bool:
        """Token i is sampled but its id is still on the device."""
        return self.num_known_tokens <= i < self.num_tokens

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        if i >= self.num_known_tokens:
            raise IndexError(f"request {self.request_id}: token {i} is not known on the host "
                             f"({self.num_known_tokens} known, {self.num_pending} pending)")
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        if end > self.num_known_tokens:
            raise IndexError(f"request {self.request_id}: tokens up to {end} asked for, "
                             f"{self.num_known_tokens} known on the host")
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
