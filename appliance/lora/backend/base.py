"""The interface every LoRA backend implements, and what it reads of a wrapped projection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

import torch
from torch import nn

from appliance.lora.batch import LoRABatchInfo

if TYPE_CHECKING:
    from kernels.segments import LoRASegments

# What a deferred gate_up_proj hands its consumer: (h, B, segments, slot ranks) for kernels/silu_mul_lora.py.
Deferred = tuple[torch.Tensor, torch.Tensor, "LoRASegments", torch.Tensor]


class StepSettings(Protocol):
    """The step's LoRA state and the start-up settings a backend reads (appliance/lora/layers.LoRAContext)."""

    info: Optional[LoRABatchInfo]
    decode_aside: bool
    side_stream: Optional["torch.cuda.Stream"]
    prefill_gemm: Optional[str]


class Projection(Protocol):
    """A LoRA-wrapped projection (appliance/lora/layers.LoRALinear): the base linear and its slot buffers."""

    base: nn.Module
    A: torch.Tensor  # [S, n, R, in]
    B: torch.Tensor  # [S, out, R]
    out_offsets: list[int]  # [n + 1]
    slice_names: tuple[str, ...]
    ctx: StepSettings


class LoRABackend:
    """y = base(x) + the step's LoRA deltas, for one projection."""

    name = "base"

    def forward(self, p: Projection, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_deferred(self, p: Projection, x: torch.Tensor) -> tuple[torch.Tensor, Optional[Deferred]]:
        """For a gate_up_proj whose consumer can add the delta itself: the base output and what the
        consumer needs for it, or (forward(x), None) where the backend does not defer."""
        return self.forward(p, x), None
