"""LoRA wrappers around the model's linears, and the slot buffers they own.

`apply_lora(model, ...)` replaces each targeted projection (qkv_proj, o_proj, gate_up_proj, down_proj)
with a `LoRALinear` that runs the base linear and adds the adapters' deltas for the step's tokens. The
model file does not change: the wrappers read the step's `LoRABatchInfo` from a shared `LoRAContext`
that the model runner fills once per step (explicit object, no globals).

Slot buffers per wrapped projection (S slots, n slices, R = max_lora_rank):
    A [S, n, R, in], B [S, out, R]; an adapter's module of rank r < R fills [:r] and leaves zeros,
    a projection the adapter does not target stays all zero (its delta is exactly 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from appliance.lora.adapter_files import AdapterError
from appliance.lora.batch import LoRABatchInfo
from appliance.models.llama import LlamaModel, MergedLinear
from kernels.reference import lora_apply_gathered, lora_apply_grouped

# Our fused module -> the PEFT projection names of its slices, in output order.
FUSED_SLICES = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass
class LoRAContext:
    """The step's LoRA state, shared by every wrapper; None = no adapter token in this step."""

    info: Optional[LoRABatchInfo] = None
    wrappers: dict[str, "LoRALinear"] = field(default_factory=dict)  # "layers.{i}.{module}" -> wrapper
    backend: str = "torch"  # lora.backend: torch | triton | csgmv
    num_slots: int = 0  # S: GPU slots of every wrapper's A/B buffers
    # lora.decode_side_stream: one-token layouts run the shrink aside (LoRALinear._decode_aside), on
    # `side_stream`; None on cpu, where the same kernels run in the same order on one stream (the tests).
    decode_aside: bool = False
    side_stream: Optional["torch.cuda.Stream"] = None
    # lora.prefill_gemm for lora_linear: None (auto) | "cublas" | "triton"
    prefill_gemm: Optional[str] = None
    # lora.max_chunk_size: csgmv's rows per chunk (also the CUDA-graph decode's sorted layout)
    max_chunk_size: int = 16
    # LoRAConfig.sorted_decode: the decode CUDA graphs may sort rows by slot (csgmv's chunks)
    sorted_decode: bool = False


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, slice_names: tuple[str, ...], slice_sizes: list[int],
                 num_slots: int, max_rank: int, ctx: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.slice_names = slice_names
        self.out_offsets = [0]
        for s in slice_sizes:
            self.out_offsets.append(self.out_offsets[-1] + s)
        w = base.weight
        n = len(slice_names)
        self.A = torch.zeros(num_slots, n, max_rank, base.in_features, dtype=w.dtype, device=w.device)
        self.B = torch.zeros(num_slots, base.out_features, max_rank, dtype=w.dtype, device=w.device)
        self.ctx = ctx
        if ctx.backend != "torch":
            # Imported here so the torch backend never needs triton (no wheel on some platforms).
            from kernels.lora_apply import fuses, lora_apply
            from kernels.lora_expand import lora_expand
            from kernels.lora_linear import lora_linear, lora_linear_pays
            from kernels.lora_shrink import lora_shrink
            from kernels.segments import rows_covered

            self._apply = lora_apply
            self._fuses, self._shrink, self._expand = fuses, lora_shrink, lora_expand
            self._rows_covered = rows_covered
            self._linear, self._linear_pays = lora_linear, lora_linear_pays

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        info = self.ctx.info
        segs = None if info is None else info.segments
        # lora_linear computes x @ Wᵀ itself: only for a plain, unbiased linear (checked per call: a
        # base swapped later for a module with its own forward, e.g. a sharded one, keeps the add after).
        own_gemm = type(self.base).forward is nn.Linear.forward and self.base.bias is None
        if segs is not None and own_gemm and x.dim() == 2 and self._linear_pays(x.shape[0], segs, x.device):
            # Prefill-shaped step: the delta written first and cuBLAS accumulating into it, or one Triton
            # GEMM adding it in its epilogue (kernels/lora_linear.py: lora.prefill_gemm); either way y
            # crosses HBM once less than with the add after.
            return self._linear(x, self.base.weight, self.A, self.B, segs, info.slot_ranks, self.out_offsets,
                                gemm=self.ctx.prefill_gemm)
        if segs is not None and self.ctx.decode_aside and (
                segs.static_sorted or (segs.max_len == 1 and not self._fuses(segs, self.A, x.device))):
            return self._decode_aside(x, info)
        y = self.base(x)
        if info is None:
            return y
        if segs is not None:
            # Kernels: y += (x @ Aᵀ) @ Bᵀ per slice, in place (one fused launch for one-token
            # segments, else lora_shrink's fp32 h then lora_expand); base rows untouched.
            self._apply(y, x, self.A, self.B, info.segments, info.slot_ranks, self.out_offsets)
        elif not info.groups:
            return y
        elif info.gather:
            lora_apply_gathered(y, x, self.A, self.B, info.token_slots, self.out_offsets)
        else:
            lora_apply_grouped(y, x, self.A, self.B, info.groups, self.out_offsets)
        return y

    def forward_deferred(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[tuple]]:
        """For a gate_up_proj whose consumer can add the delta itself (MLP with the fused kernels:
        kernels/silu_mul_lora.py). Where the step allows, returns the base output and (h, B, segments,
        slot ranks): the shrink done, the expand left to the consumer, which saves the expand's launch
        and its read and write of the [T, 2I] output (for prefill, lora_linear's write of the delta
        and cuBLAS's read of it, or lora_gemm's GEMM in place of cuBLAS's). Else (None): forward(x),
        the delta already added.

        Allowed: backend triton/csgmv, two slices, segments and base rows covering every row of x (or
        the static decode batch: one segment per row, or its slot-sorted chunks), and either
        - one-token segments (decode with distinct adapters) that lora_apply would not fuse into one
          launch, or the static decode batch's slot-sorted chunks; the shrink runs on the side stream
          beside the GEMM when lora.decode_side_stream is on;
        - multi-token segments (prefill-shaped) under lora.prefill_gemm auto (cublas or triton pin
          lora_linear for every projection, a benchmark's A/B).
        h's memory: see _base_and_shrink."""
        info = self.ctx.info
        segs = None if info is None else info.segments
        if (segs is None or segs.num_segs == 0 or len(self.slice_names) != 2
                or self._rows_covered(segs) != x.shape[0]):
            return self.forward(x), None
        if segs.max_len == 1:
            if self._fuses(segs, self.A, x.device):
                return self.forward(x), None
            side = self.ctx.side_stream if self.ctx.decode_aside else None
        elif segs.static_sorted:
            side = self.ctx.side_stream if self.ctx.decode_aside else None
        elif self.ctx.prefill_gemm is None and segs.base_rows is not None:
            side = None
        else:
            return self.forward(x), None
        y, h = self._base_and_shrink(x, info, side)
        return y, (h, self.B, segs, info.slot_ranks)

    def _decode_aside(self, x: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        """Decode (one-token segments, or the static decode batch's slot-sorted chunks): the adapters'
        shrink (x @ Aᵀ, which reads every A of the step) runs on the side stream while the base GEMM
        runs on the current one, then the expand adds into y. A decode GEMM at batch 64 leaves SMs idle
        (cuBLAS takes 96 to 128 tiles for qkv and o on 132 SMs) and the shrink is launch- and
        latency-bound, so it can fill them; the expand must follow the GEMM (it adds into y). Only for
        steps lora_apply would not fuse into one launch (the caller checks): a fused step keeps the
        plain order. No extra buffer and no extra add."""
        y, h = self._base_and_shrink(x, info, self.ctx.side_stream)
        return self._expand(y, h, self.B, info.segments, info.slot_ranks, self.out_offsets)

    def _base_and_shrink(self, x: torch.Tensor, info: LoRABatchInfo,
                         side: Optional["torch.cuda.Stream"]) -> tuple[torch.Tensor, torch.Tensor]:
        """The base output and the shrink's h (K-split planes) of a step; with a side stream
        the shrink runs on it beside the GEMM (None, e.g. on cpu: the same kernels on one stream).

        h is allocated on the side stream and read on this one after the join. Its block goes back to
        the side stream's pool once the caller drops it, and the next use of the side stream (the
        next wrapper) first waits for everything enqueued here by then, the reader of h included: no
        kernel writes the block before h has been read (also within a CUDA-graph capture, where the
        fork and join are captured as graph edges)."""
        segs = info.segments
        if side is None:
            return self.base(x), self._shrink(x, self.A, segs, info.slot_ranks, partials=True)
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)  # x is ready
        with torch.cuda.stream(side):
            h = self._shrink(x, self.A, segs, info.slot_ranks, partials=True)
        y = self.base(x)
        main.wait_stream(side)
        return y, h

    def load_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], prefix: str) -> None:
        """Fill `slot` from an adapter's weights {"layers.{i}.{proj}": (A [r, in], B·scale [out, r])}.

        Every shape is checked before the first copy (AdapterError: the caller frees the slot and fails
        only that adapter's requests); a copy's own RuntimeError would end the engine's step instead."""
        R, n_in = self.A.shape[2], self.A.shape[3]
        for i, proj in enumerate(self.slice_names):
            ab = weights.get(f"{prefix}.{proj}")
            if ab is None:
                continue
            a, b = ab
            r, rows = a.shape[0] if a.dim() == 2 else -1, self.out_offsets[i + 1] - self.out_offsets[i]
            if a.dim() != 2 or b.dim() != 2 or not 1 <= r <= R or a.shape[1] != n_in or tuple(b.shape) != (rows, r):
                raise AdapterError(f"{prefix}.{proj}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                                   f"the slot (rank <= {R}, lora_A [r, {n_in}], lora_B [{rows}, r])")
        self.A[slot].zero_()
        self.B[slot].zero_()
        for i, proj in enumerate(self.slice_names):
            ab = weights.get(f"{prefix}.{proj}")
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            lo, hi = self.out_offsets[i], self.out_offsets[i + 1]
            self.A[slot, i, :r].copy_(a, non_blocking=True)
            self.B[slot, lo:hi, :r].copy_(b, non_blocking=True)

    def clear_slot(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()


def apply_lora(model: LlamaModel, targets: tuple[str, ...], num_slots: int, max_rank: int,
               backend: str = "torch", max_chunk_size: int = 16, sorted_decode: bool = False) -> LoRAContext:
    """Wrap the projections that carry any of `targets`; return the context the runner fills per step."""
    ctx = LoRAContext(backend=backend, num_slots=num_slots, max_chunk_size=max_chunk_size,
                      sorted_decode=sorted_decode and backend != "torch")
    for i, layer in enumerate(model.layers):
        for path, names in FUSED_SLICES.items():
            if not set(names) & set(targets):
                continue
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            base = getattr(parent, attr)
            if isinstance(base, MergedLinear):
                sizes = list(base.slice_sizes.values())
            else:
                sizes = [base.out_features]
            wrapper = LoRALinear(base, names, sizes, num_slots, max_rank, ctx)
            setattr(parent, attr, wrapper)
            ctx.wrappers[f"layers.{i}.{path}"] = wrapper
    return ctx


def load_adapter_into_slot(ctx: LoRAContext, slot: int,
                           weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for key, wrapper in ctx.wrappers.items():
        layer_prefix = key.rsplit(".", 2)[0]  # "layers.{i}"
        wrapper.load_slot(slot, weights, layer_prefix)
