"""LoRA under tensor parallelism, the S-LoRA way, and adapter operations kept atomic across ranks.

Column-parallel q/k/v/gate/up keep A whole and take B's rows of the rank's output range; row-parallel
o/down take A's columns of the input range and B whole. Since B is linear, each rank adds its partial
delta to its partial base output and the block's one all-reduce sums both: no collective of its own.
Atomic: rank 0 reads first (a bad file sends nothing), then every rank reads and verifies its copy;
if any fails, all drop it and the load is refused with that rank's error. Slot fills likewise.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from appliance.config.schema import LoRAConfig
from appliance.engine.runtime import LoRARuntime
from appliance.lora.adapter import AdapterError, AdapterSpec, load_adapter_weights
from appliance.lora.batch import LoRABatchInfo, LoRAStepLayout
from appliance.lora.layers import LoRAContext, apply_lora, load_adapter_into_slot
from appliance.models.llama import LlamaModel
from appliance.parallel.group import TPGroup
from appliance.parallel.layout import SPLIT, TPLayout
from appliance.parallel.messages import DropAdapter, FillSlot, ReadAdapter

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def shard_adapter(weights: Weights, layout: TPLayout) -> Weights:
    """This rank's part of every module's (A, B): views, no copy."""
    out: Weights = {}
    for name, (a, b) in weights.items():
        proj = name.rsplit(".", 1)[1]
        lo, hi = layout.proj_range(proj)
        out[name] = (a, b[lo:hi]) if SPLIT[proj] == "out" else (a[:, lo:hi], b)
    return out


class AdapterSync:
    """Rank 0's side: LoRAManager calls it for every load, slot fill and drop (manager.tp)."""

    def __init__(self, group: TPGroup, layout: TPLayout) -> None:
        self.group = group
        self.layout = layout

    def shard(self, weights: Weights) -> Weights:
        return shard_adapter(weights, self.layout)

    def read(self, key: str, spec: AdapterSpec) -> None:
        """Every other rank reads `spec` under `key`; AdapterError (and none keeps it) if one fails."""
        self._answered(ReadAdapter(key, spec), key)

    def fill(self, slot: int, key: str) -> None:
        self._answered(FillSlot(slot, key), key)

    def drop(self, key: str) -> None:
        try:
            self.group.broadcast(DropAdapter(key))
        except RuntimeError as e:
            self.group.fail(f"dropping adapter {key!r} failed between ranks: {e}")

    def _answered(self, msg: object, key: str) -> None:
        try:
            self.group.broadcast(msg)
            answers = self.group.gather(None)
        except RuntimeError as e:  # a rank is gone (torch.distributed's errors are RuntimeErrors)
            self.group.fail(f"adapter operation on {key!r} failed between ranks: {e}")
        assert answers is not None
        errors = [(r, e) for r, e in enumerate(answers) if e is not None]
        if errors:
            if isinstance(msg, ReadAdapter):
                self.drop(key)
            raise AdapterError("; ".join(f"tensor-parallel rank {r}: {e}" for r, e in errors))


class SingleRankSync:
    """AdapterSync of tp_size 1: no other rank to mirror, the weights whole."""

    def shard(self, weights: Weights) -> Weights:
        return weights

    def read(self, key: str, spec: AdapterSpec) -> None:
        pass

    def fill(self, slot: int, key: str) -> None:
        pass

    def drop(self, key: str) -> None:
        pass


class WorkerAdapters:
    """A worker rank's side: the wrapped shard's slot buffers and a CPU tier of shards.

    The tier holds lora.max_loaded_loras shards (least recently used leave first); a fill whose shard
    left it reads the files again, as rank 0's HostCache does."""

    def __init__(self, cfg: LoRAConfig, runtime: LoRARuntime, model: LlamaModel, layout: TPLayout,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.backend = runtime.backend
        self.ctx: LoRAContext = apply_lora(model, cfg.resolved_targets(), cfg.max_loras_per_batch,
                                           cfg.max_lora_rank, self.backend, cfg.max_chunk_size,
                                           runtime.sorted_decode)
        self.specs: dict[str, AdapterSpec] = {}  # every key rank 0 holds
        self.shards: OrderedDict[str, Weights] = OrderedDict()

    def read(self, msg: ReadAdapter) -> Optional[str]:
        """None, or why this rank could not read the adapter (then it keeps nothing of it)."""
        try:
            self._put(msg.key, self._read(msg.spec))
        except (AdapterError, OSError) as e:
            return str(e)
        self.specs[msg.key] = msg.spec
        return None

    def fill(self, msg: FillSlot) -> Optional[str]:
        try:
            shard = self.shards.get(msg.key)
            if shard is None:
                spec = self.specs.get(msg.key)
                if spec is None:
                    return f"adapter {msg.key!r} was never read on this rank"
                shard = self._read(spec)
                self._put(msg.key, shard)
            self.shards.move_to_end(msg.key)
            load_adapter_into_slot(self.ctx, msg.slot, shard)
        except (AdapterError, OSError, RuntimeError) as e:
            return str(e)
        return None

    def drop(self, msg: DropAdapter) -> None:
        self.specs.pop(msg.key, None)
        self.shards.pop(msg.key, None)

    def begin_step(self, layout: Optional[LoRAStepLayout]) -> None:
        self.ctx.info = None if layout is None else LoRABatchInfo.from_layout(
            layout, self.device, self.backend, self.cfg.max_chunk_size)

    def _read(self, spec: AdapterSpec) -> Weights:
        # The whole file is read (its checksum covers every byte); only this rank's part is kept.
        weights = load_adapter_weights(spec, self.dtype, self.cfg, self.layout.args)
        return {k: (a.clone(), b.clone()) for k, (a, b) in shard_adapter(weights, self.layout).items()}

    def _put(self, key: str, shard: Weights) -> None:
        self.shards[key] = shard
        self.shards.move_to_end(key)
        while len(self.shards) > self.cfg.max_loaded_loras:
            self.shards.popitem(last=False)
