"""What callers hand the engine and what they get back: sampling parameters, output updates, errors.

This is the engine's public contract: the HTTP server (server/) and the benchmark speak only these types
plus `AsyncEngine` (engine/async_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from appliance.engine.grammar.spec import GrammarSpec

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS = 300  # entries a request's logit_bias may hold (docs/sampling.md)


class EngineError(Exception):
    """Base class of errors the engine reports to callers."""


class QueueFullError(EngineError):
    """The waiting queue is at engine.max_waiting_requests; the server answers 429 with Retry-After."""


class EngineStoppedError(EngineError):
    """The engine is shutting down or dead; the server answers 503."""


class RequestError(EngineError):
    """A request the engine cannot take (e.g. prompt plus max_tokens beyond the context); HTTP 400.
    `param`: the request field at fault, when one is (the error body's `param`)."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class AdapterNotFoundError(RequestError):
    """The request names an adapter that is not loaded (HTTP 404 model_not_found)."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 or -1 = off
    seed: Optional[int] = None  # same seed + same prompt = same text
    stop: list[str] = field(default_factory=list)  # stop strings; the matched string is not returned
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (not returned)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    min_tokens: int = 0  # EOS and stop tokens are ignored before this many tokens
    # None = no logprobs; k = the chosen token's logprob plus the k most likely (raw model distribution)
    logprobs: Optional[int] = None
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the generated text
    repetition_penalty: float = 1.0  # CTRL/HF: a token of the prompt or output has its logit / p (or * p if < 0)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the top token's
    grammar: Optional[GrammarSpec] = None  # structured output: the text must match it (engine/grammar/)
    # Prefix caching: only requests with the same salt (and adapter) share cached KV blocks; None = the
    # shared pool. A request option, not a sampling one: it rides here so it reaches every sample (n).
    cache_salt: Optional[str] = None
    skip_special_tokens: bool = True  # special tokens are left out of the text (their ids stay)
    # Special tokens written into the text even when skipping: the tool-call tags of templates that make
    # them special (Qwen2.5, Hermes), so the tool parser sees them while other markup stays out.
    kept_special_token_ids: frozenset[int] = frozenset()

    def validate(self) -> None:
        """Raise RequestError with the field name when a value is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be in 0..max_tokens, got {self.min_tokens}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise RequestError("stop must be a list of non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise RequestError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise RequestError("cache_salt must be a non-empty string")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or t < 0 or not -100.0 <= b <= 100.0:
                raise RequestError(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {t!r}: {b!r}")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise RequestError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
            try:
                self.grammar.validate()
            except ValueError as e:
                raise RequestError(f"{self.grammar.param}: {e}", param=self.grammar.param) from None

    @property
    def penalized(self) -> bool:
        """Sampling reads the tokens seen so far (the penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class TokenLogprob:
    """A generated token's logprob under the model (log_softmax of its float32 logits, before any
    penalty, bias or temperature) and the `SamplingParams.logprobs` most likely tokens, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass
class RequestOutput:
    """One update for a request: the tokens and text produced since the previous update.

    `text` never contains a partial multi-byte character, nor the start of a stop string that may
    still complete; the final update (finished=True) flushes what was held back (minus a matched stop).
    """

    request_id: str
    token_ids: list[int]  # new token ids since the last update
    text: str  # new text since the last update
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" once finished
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total generated so far
    error: Optional[str] = None  # set when finish_reason == "error"
    logprobs: Optional[list[TokenLogprob]] = None  # one per token of token_ids when params.logprobs is set
    # Per-request timestamps (time.monotonic()): metrics, and the spans of tracing (telemetry/tracing.py).
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    first_scheduled_time: Optional[float] = None
    load_wait_start: Optional[float] = None  # waited for its adapter's weights from .. to (None: did not)
    load_wait_end: Optional[float] = None
