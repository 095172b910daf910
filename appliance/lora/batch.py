"""LoRABatchInfo: the step's adapter layout, built once by the model runner and read by every layer.

`segments` holds the kernels' layout for the backend (kernels/segments.py); the grouped form (token
indices per slot) serves the `torch` backend. Built on the host and moved once, so no layer syncs.
No per-slot scaling: each module's alpha/r is folded into B at load (it is per module, not per slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.segments import LoRASegments, csgmv_segments, sgmv_segments, to_device


# Up to this many tokens in a step, gathering per-token weights beats the per-adapter loop (decode).
GATHER_MAX_TOKENS = 64


@dataclass
class LoRAStepLayout:
    """The step's adapter layout as plain lists, decided once (rank 0 under tensor parallelism, where
    it is broadcast so that every rank builds the same LoRABatchInfo)."""

    seg_lens: list[int]  # tokens of each sequence, in step order
    seg_slots: list[int]  # slot of each sequence, -1 = base
    slot_ranks: list[int]  # [S] rank of the adapter in each slot (0 = empty)


@dataclass
class LoRABatchInfo:
    seg_indptr: torch.Tensor  # [num_segs + 1] int32: token offsets of the segments
    seg_slots: torch.Tensor  # [num_segs] int32: slot of each segment, -1 = base (no adapter)
    slot_ranks: torch.Tensor  # [S] int32: rank of the adapter in each slot (0 = empty)
    token_slots: torch.Tensor  # [T] int64: slot of each token, -1 = base
    groups: list[tuple[int, torch.Tensor]]  # (slot, token indices [k] int64) per slot present
    # Few tokens, several adapters: gather each token's A/B instead of looping over adapters.
    gather: bool = False
    # Backends triton/csgmv: the kernels' segments (no base-token segment); None for torch.
    segments: Optional[LoRASegments] = None

    @classmethod
    def build(cls, seg_lens: list[int], seg_slots: list[int], slot_ranks: list[int],
              device: torch.device, backend: str = "torch", max_chunk_size: int = 16) -> "LoRABatchInfo":
        if backend != "torch":
            return cls.build_for_kernels(seg_lens, seg_slots, slot_ranks, device, backend, max_chunk_size)
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)
        token_slots: list[int] = []
        per_slot: dict[int, list[int]] = {}
        for start, n, slot in zip(indptr, seg_lens, seg_slots):
            token_slots.extend([slot] * n)
            if slot >= 0:
                per_slot.setdefault(slot, []).extend(range(start, start + n))
        groups = [(s, torch.tensor(idx, dtype=torch.long, device=device)) for s, idx in sorted(per_slot.items())]
        return cls(
            seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
            seg_slots=torch.tensor(seg_slots, dtype=torch.int32, device=device),
            slot_ranks=torch.tensor(slot_ranks, dtype=torch.int32, device=device),
            token_slots=torch.tensor(token_slots, dtype=torch.long, device=device),
            groups=groups,
            gather=len(groups) > 1 and len(token_slots) <= GATHER_MAX_TOKENS,
        )

    @classmethod
    def from_layout(cls, layout: LoRAStepLayout, device: torch.device, backend: str = "torch",
                    max_chunk_size: int = 16) -> "LoRABatchInfo":
        return cls.build(layout.seg_lens, layout.seg_slots, layout.slot_ranks, device, backend, max_chunk_size)

    @classmethod
    def build_for_kernels(cls, seg_lens: list[int], seg_slots: list[int], slot_ranks: list[int],
                          device: torch.device, backend: str, max_chunk_size: int) -> "LoRABatchInfo":
        """The kernels' form only: the torch backend's per-token and per-group tensors are not built."""
        if backend == "triton":
            segs = sgmv_segments(seg_lens, seg_slots, device)
        elif backend == "csgmv":
            segs = csgmv_segments(seg_lens, seg_slots, max_chunk_size, device)
        else:
            raise ValueError(f"unknown LoRA backend {backend!r}")
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)
        seg_indptr, slots_t, ranks_t = to_device([indptr, list(seg_slots), list(slot_ranks)], device)
        empty = torch.empty(0, dtype=torch.long, device=device)
        return cls(seg_indptr=seg_indptr, seg_slots=slots_t, slot_ranks=ranks_t, token_slots=empty,
                   groups=[], segments=segs)
