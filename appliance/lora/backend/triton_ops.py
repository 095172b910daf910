"""The triton backend (lora.backend triton and csgmv): the Triton kernels of kernels/, the path for each
step chosen by policy.py from host facts only (no sync)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import nn

from appliance.lora.backend.base import Deferred, LoRABackend, Projection
from appliance.lora.backend.policy import fuses, lora_linear_pays, prefill_gemm, refuse
from appliance.lora.batch import LoRABatchInfo
from kernels.lora_apply import lora_apply
from kernels.lora_expand import lora_expand
from kernels.lora_linear import lora_linear
from kernels.lora_shrink import lora_shrink
from kernels.segments import rows_covered


class TritonBackend(LoRABackend):
    name = "triton"

    def forward(self, p: Projection, x: torch.Tensor) -> torch.Tensor:
        info = p.ctx.info
        segs = None if info is None else info.segments
        if segs is None:
            return p.base(x)
        # lora_linear computes x @ Wᵀ itself: only for a plain, unbiased linear (a sharded base keeps the add after).
        own_gemm = type(p.base).forward is nn.Linear.forward and p.base.bias is None
        if own_gemm and x.dim() == 2 and lora_linear_pays(x.shape[0], segs, x.device):
            return self._prefill(p, x, info)
        fused = fuses(segs, p.A, x.device)
        if p.ctx.decode_aside and (segs.static_sorted or (segs.max_len == 1 and not fused)):
            y, h = self._base_and_shrink(p, x, info, p.ctx.side_stream)
            return lora_expand(y, h, p.B, segs, info.slot_ranks, p.out_offsets)
        y = p.base(x)
        # y += (x @ Aᵀ) @ Bᵀ per slice, in place; base rows untouched.
        return lora_apply(y, x, p.A, p.B, segs, info.slot_ranks, p.out_offsets, fused=fused)

    def _prefill(self, p: Projection, x: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        """The delta written first and cuBLAS accumulating into it, or one Triton GEMM adding it in its
        epilogue (lora.prefill_gemm; None = by the step's shape)."""
        segs, W = info.segments, p.base.weight
        gemm = p.ctx.prefill_gemm
        if gemm is not None:
            return lora_linear(x, W, p.A, p.B, segs, info.slot_ranks, p.out_offsets, gemm=gemm)
        if prefill_gemm(x, W, p.out_offsets, segs, p.A) == "triton":
            try:
                return lora_linear(x, W, p.A, p.B, segs, info.slot_ranks, p.out_offsets, gemm="triton")
            except triton.runtime.errors.OutOfResources:
                refuse(x, W, p.out_offsets, p.A)  # less shared memory than the tiles were sized for
        return lora_linear(x, W, p.A, p.B, segs, info.slot_ranks, p.out_offsets, gemm="cublas")

    def forward_deferred(self, p: Projection, x: torch.Tensor) -> tuple[torch.Tensor, Optional[Deferred]]:
        """Deferred where the step allows (two slices; segments and base rows cover every row of x):
        one-token segments that lora_apply would not fuse, or the static decode batch's slot-sorted
        chunks (the shrink aside under lora.decode_side_stream); multi-token segments under
        lora.prefill_gemm auto. h's memory: see _base_and_shrink."""
        info = p.ctx.info
        segs = None if info is None else info.segments
        if segs is None or segs.num_segs == 0 or len(p.slice_names) != 2 or rows_covered(segs) != x.shape[0]:
            return self.forward(p, x), None
        aside = p.ctx.side_stream if p.ctx.decode_aside else None
        if segs.max_len == 1:
            if fuses(segs, p.A, x.device):
                return self.forward(p, x), None
            side = aside
        elif segs.static_sorted:
            side = aside
        elif p.ctx.prefill_gemm is None and segs.base_rows is not None:
            side = None
        else:
            return self.forward(p, x), None
        y, h = self._base_and_shrink(p, x, info, side)
        return y, (h, p.B, segs, info.slot_ranks)

    @staticmethod
    def _base_and_shrink(p: Projection, x: torch.Tensor, info: LoRABatchInfo,
                         side: Optional["torch.cuda.Stream"]) -> tuple[torch.Tensor, torch.Tensor]:
        """The base output and the shrink's h (K-split planes), the shrink beside the GEMM on `side` if given.
        h is allocated on the side stream and read here after the join; that stream's next use waits
        for h's reader (also under graph capture: fork and join are edges)."""
        segs = info.segments
        if side is None:
            return p.base(x), lora_shrink(x, p.A, segs, info.slot_ranks, partials=True)
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)  # x is ready
        with torch.cuda.stream(side):
            h = lora_shrink(x, p.A, segs, info.slot_ranks, partials=True)
        y = p.base(x)
        main.wait_stream(side)
        return y, h
