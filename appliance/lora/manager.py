"""The engine's LoRA subsystem: registry + CPU tier + GPU slot pool + the wrapped model's slot buffers.

Requests carry an adapter *key* `name@generation`, fixed when the request is added: an in-place reload
bumps the generation, so requests already in flight finish on the old weights (old key) while new ones
get the new weights (new key). A key stays alive while any request uses it; unloading removes the name
from the registry at once (new requests get 404) and retires the key, which is dropped from the slot
pool and the CPU tier once its last request is done.

Control decisions (which slot, which victim) are made by the pure-Python pool; this class only wires
them to tensors. It runs on the engine thread; the HTTP layer reaches it through the async engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from appliance.config.schema import LoRAConfig
from appliance.lora.adapter import AdapterSpec, inspect_adapter, load_adapter_weights, resolve_adapter_path
from appliance.lora.batch import LoRABatchInfo
from appliance.lora.cache import HostCache
from appliance.lora.layers import LoRAContext, apply_lora, load_adapter_into_slot
from appliance.lora.pool import SlotPool
from appliance.lora.registry import AdapterEntry, LoRAStateError, Registry
from appliance.models.llama import LlamaModel

log = logging.getLogger(__name__)

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def adapter_key(name: str, generation: int) -> str:
    return f"{name}@{generation}"


@dataclass
class KeyState:
    spec: AdapterSpec
    in_flight: int = 0  # requests (waiting or running) that use this key
    retired: bool = False  # unloaded or replaced: drop once in_flight reaches 0


class LoRAManager:
    def __init__(self, cfg: LoRAConfig, model: LlamaModel, base_name: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.args = model.args
        self.base_name = base_name
        self.dtype = dtype
        self.device = device
        self.registry = Registry()
        self.pool = SlotPool(cfg.max_loras_per_batch, cfg.eviction_policy)
        self.keys: dict[str, KeyState] = {}
        self.host = HostCache(cfg.max_loaded_loras, self._read_weights)
        self.ctx: LoRAContext = apply_lora(model, cfg.resolved_targets(), cfg.max_loras_per_batch,
                                           cfg.max_lora_rank)
        self.slot_ranks = [0] * cfg.max_loras_per_batch

    # ------------------------------------------------------------------ admin operations
    def load(self, name: str, path: str, pinned: bool = False, inplace: bool = False) -> AdapterEntry:
        """Register (or with `inplace`, replace) an adapter. Raises AdapterError / LoRAStateError and
        then leaves everything as it was."""
        resolved = resolve_adapter_path(path, self.cfg.adapter_roots)
        spec = inspect_adapter(resolved, self.cfg, self.args)
        old: Optional[AdapterEntry] = None
        if inplace:
            old = self.registry.get(name)  # 404 when unknown
        elif name in self.registry.names():
            raise LoRAStateError(f"adapter {name!r} is already loaded (use load_inplace to replace it)", 409)
        if name == self.base_name:
            raise LoRAStateError(f"adapter name {name!r} is the base model's name", 400)
        # Read the weights now so a corrupt file fails before anything changes.
        weights = load_adapter_weights(spec, self.dtype)
        fields = dict(path=str(resolved), pinned=pinned, checksum=spec.checksum, rank=spec.rank,
                      target_modules=spec.target_modules, base_model_name=spec.base_model_name)
        entry = self.registry.replace(name, **fields) if old is not None else self.registry.add(name, **fields)
        key = adapter_key(name, entry.generation)
        self.keys[key] = KeyState(spec)
        self.host.put(key, weights)
        if pinned:
            try:
                self._pin(key)
            except LoRAStateError:
                self._rollback_add(name, key, old)
                raise
        if old is not None:
            # Requests in flight on the old weights keep them until they finish.
            self._retire(adapter_key(name, old.generation))
        return entry

    def unload(self, name: str) -> None:
        entry = self.registry.get(name)  # 404 when unknown
        self.registry.remove(name)
        self._retire(adapter_key(name, entry.generation))

    def resolve(self, model: Optional[str]) -> Optional[str]:
        """The adapter key for an OpenAI `model` / native lora_path value (None = base model)."""
        if model is None:
            return None
        name = self.registry.resolve_model(model, self.base_name)
        if name is None:
            return None
        return adapter_key(name, self.registry.get(name).generation)

    # ------------------------------------------------------------------ request lifecycle
    def request_added(self, key: str) -> None:
        self.keys[key].in_flight += 1

    def request_done(self, key: str) -> None:
        st = self.keys[key]
        st.in_flight -= 1
        if st.retired and st.in_flight == 0:
            self._drop(key)

    # ------------------------------------------------------------------ per step
    def ensure_loaded(self, loads: list[tuple[int, str]]) -> None:
        """Copy each (slot, key) the scheduler just assigned into the slot buffers."""
        for slot, key in loads:
            weights = self.host.get(key)
            load_adapter_into_slot(self.ctx, slot, weights)
            self.slot_ranks[slot] = self.keys[key].spec.rank

    def begin_step(self, seg_lens: list[int], seg_keys: list[Optional[str]]) -> None:
        slots = [-1 if k is None else self.pool.lookup(k) for k in seg_keys]
        if any(s is None for s in slots):
            raise RuntimeError("a scheduled adapter has no slot")
        self.ctx.info = None if all(s == -1 for s in slots) else LoRABatchInfo.build(
            seg_lens, slots, self.slot_ranks, self.device)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ internals
    def _read_weights(self, key: str) -> Weights:
        st = self.keys[key]
        return load_adapter_weights(st.spec, self.dtype)

    def _pin(self, key: str) -> None:
        acquired = self.pool.pin(key)  # raises LoRAStateError when over the limit or no slot is free
        if acquired.needs_load:
            self.ensure_loaded([(acquired.slot, key)])
        self.host.pin(key)

    def _retire(self, key: str) -> None:
        st = self.keys.get(key)
        if st is None:
            return
        st.retired = True
        if st.in_flight == 0:
            self._drop(key)

    def _drop(self, key: str) -> None:
        slot = self.pool.lookup(key)
        if slot is not None:
            self.pool.remove(key)  # also for pinned keys: unloading ends the pin
            self.slot_ranks[slot] = 0
        if key in self.host:
            self.host.drop(key)
        del self.keys[key]

    def _rollback_add(self, name: str, key: str, old: Optional[AdapterEntry]) -> None:
        del self.keys[key]
        self.host.drop(key)
        if old is None:
            self.registry.remove(name)
        else:
            self.registry.restore(old)
