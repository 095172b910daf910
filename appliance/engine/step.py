"""The per-step data types: what the runner builds from a scheduler plan, what TP rank 0 broadcasts, and
the tensors a forward reads. Imported by the runner, the decode graphs, the warm-up and parallel/ alike."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from appliance.models.attention import AttentionMetadata

if TYPE_CHECKING:
    from appliance.lora.batch import LoRAStepLayout


@dataclass
class StepBatch:
    """One step as host lists: what `inputs` turns into tensors, and what TP rank 0 broadcasts."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]: KV cache slot of each token
    prefills: list[tuple[int, int, int, list[int]]]  # (q_start, q_len, context_len, block table)
    num_prefill_tokens: int
    decode_tables: list[list[int]]  # [D, max_blocks], padded with 0
    decode_context_lens: list[int]  # [D]
    logits_indices: list[int]  # [N]
    lora: Optional["LoRAStepLayout"] = None  # the adapters' segments; None = no adapter token


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N]: row of each sampling sequence's last token in the step


def padded_size(sizes: list[int], n: int) -> Optional[int]:
    """The smallest of the captured `sizes` (ascending) that holds n rows; None = none does (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
