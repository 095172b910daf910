"""A launched step whose sampled tokens are still on their way to the host (async scheduling).

With `engine.async_scheduling`, a decode step over the static buffers (engine/cuda_graph.py) is
launched, its tokens are sampled on the device and copied to pinned host memory behind an event, and
the engine returns to the host work of the next step (scheduling, staging, launching it) before it
reads them. The next step's rows take their input tokens from the device (StaticDecode.publish), so
the GPU runs step N + 1 while the host detokenises, checks stops and streams step N's tokens. Without
it the GPU waits for the host between every two steps, a sizeable part of a graphed decode step.

The cost: a sequence that ends at step N on a stop token or string has already been given a row of
step N + 1, whose token is dropped. One that ends by length is known to end (`Sequence.finishing`) and
is not scheduled again.
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
