"""What rank 0 broadcasts to the other tensor-parallel ranks: plain, picklable dataclasses.

Rank 0 runs the scheduler, the registry and the slot pool; the other ranks only follow. Every decision
(which tokens, which blocks, which adapter in which slot) is made once on rank 0 and sent as data, so
all ranks run exactly the same forward and hold the same adapters in the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.engine.step import StepBatch
from appliance.lora.adapter import AdapterSpec


@dataclass
class RunStep:
    batch: StepBatch


@dataclass
class SetupDecode:
    """Build StaticDecode of these batch sizes now (captured as CUDA graphs when `capture`), as rank 0
    does right after sending this: every rank captures the same graphs in the same order. The decode
    steps themselves are sent as ints and tensors, not as messages (group.py, DECODE)."""

    sizes: list[int]
    capture: bool


@dataclass
class ReadAdapter:
    """Read (and verify) an adapter's files and keep this rank's shard under `key`. Answered."""

    key: str
    spec: AdapterSpec


@dataclass
class FillSlot:
    """Copy `key`'s shard into GPU slot `slot` (re-read from disk if it left this rank's CPU tier). Answered."""

    slot: int
    key: str


@dataclass
class DropAdapter:
    """Forget `key` (unloaded, replaced, or a load that another rank failed). Not answered."""

    key: str


@dataclass
class Stop:
    """Leave the loop, close the process group, exit 0."""
