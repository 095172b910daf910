"""The engine's LoRA subsystem: registry + CPU tier + GPU slot pool + the wrapped model's slot buffers.

Requests carry an adapter *key* `name@N`, fixed when the request is added. Every load, in-place reloads
included, makes a new key (N never repeats, even when a name is unloaded and loaded again), so
requests already in flight finish on the old weights (old key) while new ones get the new weights. A key stays alive while any request uses it; unloading removes the name
from the registry at once (new requests get 404) and retires the key, which is dropped from the slot
pool and the CPU tier once its last request is done.

Control decisions (which slot, which victim) are made by the pure-Python pool; this class only wires
them to tensors. It runs on the engine thread; the HTTP layer reaches it through the async engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import torch

from appliance.config.schema import ConfigError, LoRAConfig
from appliance.engine.stats import LoadTier, StatsRecorder
from appliance.lora.adapter import AdapterError, AdapterSpec, inspect_adapter, load_adapter_weights, resolve_adapter_path
from appliance.lora.batch import LoRABatchInfo, LoRAStepLayout
from appliance.lora.cache import HostCache
from appliance.lora.layers import LoRAContext, apply_lora, load_adapter_into_slot
from appliance.lora.pool import SlotPool
from appliance.lora.registry import AdapterEntry, LoRAStateError, Registry
from appliance.models.llama import LlamaModel, ModelArgs

if TYPE_CHECKING:
    from appliance.parallel.lora import AdapterSync

log = logging.getLogger(__name__)

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]
T = TypeVar("T")


@dataclass
class KeyState:
    spec: AdapterSpec
    in_flight: int = 0  # requests (waiting or running) that use this key
    retired: bool = False  # unloaded or replaced: drop once in_flight reaches 0


class LoRAManager:
    def __init__(self, cfg: LoRAConfig, model: LlamaModel, base_name: str, dtype: torch.dtype,
                 device: torch.device, stats: Optional[StatsRecorder] = None,
                 args: Optional[ModelArgs] = None, tp: Optional["AdapterSync"] = None) -> None:
        self.cfg = cfg
        # Loads (disk -> cpu, cpu -> gpu) and evictions of both tiers, for metrics.
        self.stats = stats if stats is not None else StatsRecorder()
        # The full model's shapes (adapters are checked against them); under tensor parallelism
        # `model` is rank 0's shard and `tp` mirrors every load, fill and drop on the other ranks.
        self.args = args if args is not None else model.args
        self.tp = tp
        self.base_name = base_name
        self.dtype = dtype
        self.device = device
        self.registry = Registry()
        self.pool = SlotPool(cfg.max_loras_per_batch, cfg.eviction_policy,  # type: ignore[arg-type]
                             on_evict=lambda _: self.stats.eviction("gpu", cfg.eviction_policy))
        self.keys: dict[str, KeyState] = {}  # every live key, current or retiring
        self.current: dict[str, str] = {}  # adapter name -> the key new requests get
        self._key_numbers = itertools.count()
        self.host = HostCache(cfg.max_loaded_loras, self._read_weights,
                              on_evict=lambda _: self.stats.eviction("cpu", "lru"))
        if cfg.backend != "torch":
            from kernels.platform import triton_unavailable_reason

            why = triton_unavailable_reason(device)
            if why is not None:
                raise ConfigError(f"lora.backend: {cfg.backend!r} cannot run here: {why}")
        self.ctx: LoRAContext = apply_lora(model, cfg.resolved_targets(), cfg.max_loras_per_batch,
                                           cfg.max_lora_rank, cfg.backend)
        self.slot_ranks = [0] * cfg.max_loras_per_batch

    # ------------------------------------------------------------------ admin operations
    def load(self, name: str, path: str, pinned: bool = False, inplace: bool = False) -> AdapterEntry:
        """Register (or with `inplace`, replace) an adapter.

        Every check comes before the first change (names, then files, then the pin), so a refused
        load raises AdapterError / LoRAStateError and leaves registry, slots and CPU tier as they were.
        """
        old: Optional[AdapterEntry] = None
        if inplace:
            old = self.registry.get(name)  # 404 when unknown
        elif name in self.registry:
            raise LoRAStateError(f"adapter {name!r} is already loaded (use load_inplace to replace it)", 409)
        if name == self.base_name:
            raise LoRAStateError(f"adapter name {name!r} is the base model's name", 400)
        resolved = resolve_adapter_path(path, self.cfg.adapter_roots)
        spec = inspect_adapter(resolved, self.cfg, self.args)
        t0 = time.perf_counter()
        # A corrupt file fails here, before any change (counted as a failed disk -> cpu load).
        weights = self._timed("cpu", lambda: load_adapter_weights(spec, self.dtype), record_ok=False)
        read_s = time.perf_counter() - t0
        old_key = self.current[name] if old is not None else None
        key = f"{name}@{next(self._key_numbers)}"
        if self.tp is not None:
            self.tp.read(key, spec)  # every other rank reads its shard; any failure: none keeps it
        try:
            self._claim_pin(key, spec, weights, pinned, old, old_key)
        except Exception:
            if self.tp is not None:
                self.tp.drop(key)  # refused: the other ranks forget the shard they read
            raise
        fields = dict(path=str(resolved), pinned=pinned, checksum=spec.checksum, rank=spec.rank,
                      target_modules=spec.target_modules, base_model_name=spec.base_model_name)
        entry = self.registry.replace(name, **fields) if old is not None else self.registry.add(name, **fields)
        self.current[name] = key
        self.keys[key] = KeyState(spec)
        self.host.put(key, weights)
        if pinned:
            self.host.pin(key)
        if old_key is not None:
            # Requests in flight on the old weights keep them until they finish.
            self._retire(old_key)
        self.stats.load("cpu", True, read_s)  # counted once the load is committed, not when refused
        return entry

    def _claim_pin(self, key: str, spec: AdapterSpec, weights: Weights, pinned: bool,
                   old: Optional[AdapterEntry], old_key: Optional[str]) -> None:
        """The pin part of `load`: take a pinned slot for `key` (or hand the old generation's pin over or
        back). Raises with the pins as they were."""
        if pinned:
            # A pinned adapter reloaded in place hands its pin to the new weights: unpin the old
            # generation first so the swap does not count twice against the pin limit.
            if old_key is not None and old.pinned:
                self.pool.unpin(old_key)
            try:
                acquired = self.pool.pin(key)
            except LoRAStateError:
                if old_key is not None and old.pinned:
                    self.pool.pin(old_key)  # give the pin back: it was ours a moment ago
                raise
            if acquired.needs_load:
                try:
                    self._fill_pinned(acquired.slot, key, spec, weights)
                except AdapterError:
                    if old_key is not None and old.pinned:
                        self.pool.pin(old_key)
                    raise
        elif old_key is not None and old.pinned:
            self.pool.unpin(old_key)  # reloaded without pinned=true: the new weights are not pinned

    def unload(self, name: str) -> None:
        self.registry.remove(name)  # 404 when unknown
        self._retire(self.current.pop(name))

    @staticmethod
    def name_of(key: str) -> str:
        """The adapter name of a key: keys are "<name>@<N>" (see `load`), and names may contain '@'."""
        return key.rpartition("@")[0]

    def tier(self, name: str) -> str:
        """Where a registered adapter's current weights are: "gpu" (a slot), "cpu" (host memory) or
        "disk" (read again on its next request)."""
        key = self.current[name]
        return "gpu" if self.pool.lookup(key) is not None else "cpu" if key in self.host else "disk"

    def tier_counts(self) -> dict[str, int]:
        out = {"gpu": 0, "cpu": 0, "disk": 0}
        for name in self.current:
            out[self.tier(name)] += 1
        return out

    def set_pinned(self, name: str, pinned: bool) -> AdapterEntry:
        """Pin or unpin a loaded adapter without reloading it (same weights, same key).

        Pinning takes a GPU slot now (loading the weights into it when needed) and keeps the weights
        in the CPU tier; it is refused, with nothing changed, at the pin limit or with no slot free.
        Asking for the state the adapter already has is a no-op.
        """
        entry = self.registry.get(name)  # 404 when unknown
        if entry.pinned == pinned:
            return entry
        key = self.current[name]
        if pinned:
            weights = self.host.get(key)  # a cold read that fails leaves everything as it was
            acquired = self.pool.pin(key)
            if acquired.needs_load:
                self._fill_pinned(acquired.slot, key, self.keys[key].spec, weights)
            self.host.pin(key)
        else:
            self.pool.unpin(key)
            self.host.unpin(key)
        return self.registry.set_pinned(name, pinned)

    def resolve(self, model: Optional[str]) -> Optional[str]:
        """The adapter key for an OpenAI `model` / native lora_path value (None = base model)."""
        if model is None:
            return None
        name = self.registry.resolve_model(model, self.base_name)
        if name is None:
            return None
        return self.current[name]

    # ------------------------------------------------------------------ request lifecycle
    def request_added(self, key: str) -> None:
        self.keys[key].in_flight += 1

    def request_done(self, key: str) -> None:
        st = self.keys[key]
        st.in_flight -= 1
        if st.retired and st.in_flight == 0:
            self._drop(key)

    # ------------------------------------------------------------------ per step
    def ensure_loaded(self, loads: list[tuple[int, str]]) -> dict[str, str]:
        """Copy each (slot, key) the scheduler just assigned into the slot buffers. Returns the keys
        whose weights could not be read (key -> why): a file deleted, truncated, made unreadable or
        changed on disk since the adapter was registered. Their slots hold no valid weights; the
        engine fails their requests, then calls `load_failed`."""
        failed: dict[str, str] = {}
        for slot, key in loads:
            try:
                weights = self.host.get(key)
                self._fill_slot(slot, key, self.keys[key].spec, weights)
            except AdapterError as e:  # the read, or under TP another rank's read or copy
                failed[key] = str(e)
        return failed

    def load_failed(self, key: str) -> None:
        """Free the slot a key got for a load that failed (its requests are gone), so the next request
        of that adapter reads the files again and any other adapter may take the slot."""
        slot = self.pool.lookup(key)
        if slot is not None:
            self.pool.remove(key)
            self.slot_ranks[slot] = 0

    def _fill_pinned(self, slot: int, key: str, spec: AdapterSpec, weights: Weights) -> None:
        """`_fill_slot` for a slot `pin` just gave `key`: a failure (another rank could not fill its
        shard) gives the slot back before it is raised."""
        try:
            self._fill_slot(slot, key, spec, weights)
        except AdapterError:
            self.pool.remove(key)
            self.slot_ranks[slot] = 0
            raise

    def _fill_slot(self, slot: int, key: str, spec: AdapterSpec, weights: Weights) -> None:
        def copy() -> None:
            load_adapter_into_slot(self.ctx, slot, weights if self.tp is None else self.tp.shard(weights))
            if self.tp is not None:
                self.tp.fill(slot, key)  # AdapterError when another rank fails: this slot is not valid
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copy's real duration, not its launch

        self._timed("gpu", copy)
        self.slot_ranks[slot] = spec.rank

    def begin_step(self, seg_lens: list[int], seg_keys: list[Optional[str]]) -> Optional[LoRAStepLayout]:
        """Set the step's LoRABatchInfo; returns its layout (None: no adapter token) for other TP ranks."""
        slots = [-1 if k is None else self.pool.lookup(k) for k in seg_keys]
        if any(s is None for s in slots):
            raise RuntimeError("a scheduled adapter has no slot")
        layout = None if all(s == -1 for s in slots) else LoRAStepLayout(
            list(seg_lens), slots, list(self.slot_ranks))  # type: ignore[arg-type]
        self.ctx.info = None if layout is None else LoRABatchInfo.from_layout(
            layout, self.device, self.cfg.backend, self.cfg.max_chunk_size)
        return layout

    # ------------------------------------------------------------------ internals
    def _read_weights(self, key: str) -> Weights:
        """A cold read (CPU tier miss). The path is confined again: the dir or its files may have been
        replaced by symlinks leading out of lora.adapter_roots since the adapter was registered."""
        st = self.keys[key]

        def read() -> Weights:
            resolve_adapter_path(str(st.spec.path), self.cfg.adapter_roots)
            return load_adapter_weights(st.spec, self.dtype)

        return self._timed("cpu", read)

    def _timed(self, tier: LoadTier, fn: Callable[[], T], record_ok: bool = True) -> T:
        """Run a load of `tier`; record it (failures always, successes when `record_ok`) and re-raise."""
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception:
            self.stats.load(tier, False, time.perf_counter() - t0)
            raise
        if record_ok:
            self.stats.load(tier, True, time.perf_counter() - t0)
        return out

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
        if self.tp is not None:
            self.tp.drop(key)
