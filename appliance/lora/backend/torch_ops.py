"""The torch backend: plain torch ops on any device, tokens grouped by slot on the host per step."""

from __future__ import annotations

import torch

from appliance.lora.backend.base import LoRABackend, Projection
from kernels.reference import lora_apply_gathered, lora_apply_grouped


class TorchBackend(LoRABackend):
    name = "torch"

    def forward(self, p: Projection, x: torch.Tensor) -> torch.Tensor:
        y = p.base(x)
        info = p.ctx.info
        if info is None or not info.groups:
            return y
        if info.gather:
            lora_apply_gathered(y, x, p.A, p.B, info.token_slots, p.out_offsets)
        else:
            lora_apply_grouped(y, x, p.A, p.B, info.groups, p.out_offsets)
        return y
