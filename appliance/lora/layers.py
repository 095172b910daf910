"""LoRA wrappers around the model's linears, and the slot buffers they own.

`apply_lora` replaces each targeted projection with a `LoRALinear` whose backend (lora/backend/,
chosen once) runs the base linear and adds the step's deltas, read from the shared `LoRAContext` the
runner fills once per step, so the model file does not change. Slot buffers: A [S, n, R, in],
B [S, out, R]; rank r < R fills [:r], untargeted projections stay zero (delta exactly 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from appliance.lora.adapter_files import AdapterError
from appliance.lora.backend import LoRABackend, make_backend
from appliance.lora.backend.base import Deferred
from appliance.lora.batch import LoRABatchInfo
from appliance.models.llama import LlamaModel, MergedLinear

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
    ops: LoRABackend = field(init=False)  # made from `backend` once, here (appliance/lora/backend/)
    num_slots: int = 0  # S: GPU slots of every wrapper's A/B buffers
    # lora.decode_side_stream: one-token layouts run the shrink aside (backend/triton_ops.py), on
    # `side_stream`; None on cpu, where the same kernels run in the same order on one stream (the tests).
    decode_aside: bool = False
    side_stream: Optional["torch.cuda.Stream"] = None
    # lora.prefill_gemm for lora_linear: None (auto) | "cublas" | "triton"
    prefill_gemm: Optional[str] = None
    # lora.max_chunk_size: csgmv's rows per chunk (also the CUDA-graph decode's sorted layout)
    max_chunk_size: int = 16
    # LoRAConfig.sorted_decode: the decode CUDA graphs may sort rows by slot (csgmv's chunks)
    sorted_decode: bool = False

    def __post_init__(self) -> None:
        self.ops = make_backend(self.backend)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.ops.forward(self, x)

    def forward_deferred(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[Deferred]]:
        """For a gate_up_proj whose consumer can add the delta itself (MLP with the fused kernels:
        kernels/silu_mul_lora.py): the base output and (h, B, segments, slot ranks) where the backend
        defers the expand, else (forward(x), None)."""
        return self.ctx.ops.forward_deferred(self, x)

    def load_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], prefix: str) -> None:
        """Fill `slot` from an adapter's weights {"layers.{i}.{proj}": (A [r, in], B·scale [out, r])}.

        Every shape is checked before the first copy (AdapterError: the caller frees the slot and fails
        only that adapter's requests); a copy's own RuntimeError would end the engine's step instead."""
        self.check_slot(weights, prefix)
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

    def check_slot(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], prefix: str) -> None:
        """AdapterError unless every (A, B) of this module in `weights` fits a slot (`load_slot`'s check,
        also run before a side-stream copy is queued)."""
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

    def clear_slot(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()


def apply_lora(model: LlamaModel, targets: tuple[str, ...], num_slots: int, max_rank: int,
               backend: str = "torch", max_chunk_size: int = 16, sorted_decode: bool = False,
               prefill_gemm: Optional[str] = None, decode_aside: bool = False,
               side_stream: Optional["torch.cuda.Stream"] = None) -> LoRAContext:
    """Wrap the projections that carry any of `targets`; return the context the runner fills per step.
    The keywords are LoRAContext's fields of the same names (the resolved runtime settings)."""
    ctx = LoRAContext(backend=backend, num_slots=num_slots, max_chunk_size=max_chunk_size,
                      sorted_decode=sorted_decode and backend != "torch", prefill_gemm=prefill_gemm,
                      decode_aside=decode_aside, side_stream=side_stream)
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


def check_adapter_fits(ctx: LoRAContext, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """AdapterError unless `weights` fit the slots of every wrapper (nothing is copied)."""
    for key, wrapper in ctx.wrappers.items():
        wrapper.check_slot(weights, key.rsplit(".", 2)[0])


def load_adapter_into_slot(ctx: LoRAContext, slot: int,
                           weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for key, wrapper in ctx.wrappers.items():
        layer_prefix = key.rsplit(".", 2)[0]  # "layers.{i}"
        wrapper.load_slot(slot, weights, layer_prefix)
