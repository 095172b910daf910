"""A launched step whose sampled tokens are still on their way to the host (async scheduling).

With `engine.async_scheduling` a graphed decode step samples on the device and copies its tokens to
pinned memory behind an event; the engine schedules and launches step N + 1 (whose rows read their
inputs on the device, StaticDecode.publish) before it reads step N's tokens, so the GPU does not wait
for the host. Cost: a sequence stopped by a stop token at step N already holds a row of step N + 1,
whose token is dropped; one ending by length is known in advance (`Sequence.finishing`).
A step whose sampling reads the tokens so far (grammar masks, penalties) launches its forward, reads
step N's tokens while it runs, fills its masks, and only then queues its sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from appliance.engine.sampler import DeviceSample
from appliance.engine.sequence import Sequence


@dataclass(eq=False)
class LaunchedStep:
    sampling: list[Sequence]  # the sequences that sample in it, in the order of their token rows
    host: torch.Tensor  # DeviceSample.for_host() on the host (pinned on cuda), once `ready` completed
    ready: Optional[torch.cuda.Event]  # None on cpu: the copy was synchronous
    rows: dict[Sequence, int] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = {seq: i for i, seq in enumerate(self.sampling)}

    @classmethod
    def start(cls, sampling: list[Sequence], drawn: DeviceSample) -> "LaunchedStep":
        """Queue the copy of the step's tokens (and logprobs) to the host; no host wait."""
        tokens = drawn.for_host()
        if tokens.device.type != "cuda":
            return cls(sampling, tokens.cpu(), None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(sampling, host, ready)

    def source_rows(self, seqs: list[Sequence]) -> list[int]:
        """The row of each sequence's token in this step (-1 = not in it)."""
        return [self.rows.get(s, -1) for s in seqs]

    def tokens(self) -> tuple[list[int], Optional[list]]:
        """Wait for the copy; (the tokens, their per-row TokenLogprob or None) (raises what the device
        raised)."""
        if self.ready is not None:
            self.ready.synchronize()
        return DeviceSample.read(self.host, [s.params for s in self.sampling])
