"""LoRABatchInfo: the step's adapter layout, built once by the model runner and read by every layer.

The step's tokens are sequences back to back, so each sequence is one segment with one slot. The
segment form (pointers + slot per segment + per-slot rank) is what segmented kernels (SGMV) take; the
grouped form (token indices per slot) is what the torch backend takes. Both are built on the host from
Python lists and moved to the device once, so no layer ever syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Up to this many tokens in a step, gathering per-token weights beats the per-adapter loop (decode).
GATHER_MAX_TOKENS = 64


@dataclass
class LoRABatchInfo:
    seg_indptr: torch.Tensor  # [num_segs + 1] int32: token offsets of the segments
    seg_slots: torch.Tensor  # [num_segs] int32: slot of each segment, -1 = base (no adapter)
    slot_ranks: torch.Tensor  # [S] int32: rank of the adapter in each slot (0 = empty)
    token_slots: torch.Tensor  # [T] int64: slot of each token, -1 = base
    groups: list[tuple[int, torch.Tensor]]  # (slot, token indices [k] int64) per slot present
    # Few tokens, several adapters: gather each token's A/B instead of looping over adapters.
    gather: bool = False

    @classmethod
    def build(cls, seg_lens: list[int], seg_slots: list[int], slot_ranks: list[int],
              device: torch.device) -> "LoRABatchInfo":
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
