"""The per-step data types: what the runner builds from a scheduler plan, what TP rank 0 broadcasts, and
the tensors a forward reads. Imported by the runner, the decode graphs, the warm-up and parallel/ alike."""

from __future__ import annotations

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
