"""The engine's LoRA subsystem: registry + CPU tier + GPU slot pool + the wrapped model's slot buffers.

Requests carry a key `name@N` fixed when added; every load (reloads included) makes a new N, so
requests in flight finish on the old weights. Unloading removes the name at once (404) and retires the
key, dropped from slots and CPU tier after its last request. Decisions come from the pure-Python pool;
this class wires them to tensors, on the engine thread. With overlap loading, `adapter_ready` starts
background reads and side-stream copies while other requests run; outcomes of dropped keys are discarded.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import torch

from appliance.config.schema import LoRAConfig
from appliance.engine.runtime import LoRARuntime
from appliance.telemetry.stats import AdapterResidency, LoadTier, StatsRecorder
from appliance.lora.adapter import AdapterError, AdapterSpec, adapter_weights, load_adapter_weights, read_adapter
from appliance.lora.batch import LoRABatchInfo, LoRAStepLayout
from appliance.lora.cache import HostCache
from appliance.lora.layers import LoRAContext, apply_lora, check_adapter_fits, load_adapter_into_slot
from appliance.lora.pool import SlotPool
from appliance.lora.reader import BackgroundReader
from appliance.lora.sources.fetch import AdapterSources, shown_as_source
from appliance.lora.names import shown
from appliance.lora.registry import AdapterEntry, LoRAStateError, Registry, check_name
from appliance.models.llama import LlamaModel, ModelArgs
from appliance.parallel.lora import SingleRankSync

if TYPE_CHECKING:
    from appliance.parallel.lora import AdapterSync

log = logging.getLogger(__name__)

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]
T = TypeVar("T")


@dataclass(frozen=True)
class PreparedLoad:
    """An adapter dir resolved, inspected and read off the engine thread (`LoRAManager.prepare`), for
    `load` to commit; or why that failed, reported by `load` after its name checks, as an inline read."""

    resolved: Optional[Path] = None
    spec: Optional[AdapterSpec] = None
    weights: Optional[Weights] = None
    read_s: float = 0.0  # reading the weights (the disk -> cpu load's duration)
    error: Optional[AdapterError] = None
    read_failed: bool = False  # the error came from reading the weights (counted as a failed cpu load)
    fetch_s: Optional[float] = None  # a remote adapter's download (remote -> disk load); None: none ran
    fetch_failed: bool = False  # the error came from the store or the download (a failed disk load)


@dataclass
class KeyState:
    spec: AdapterSpec
    in_flight: int = 0  # requests (waiting or running) that use this key
    retired: bool = False  # unloaded or replaced: drop once in_flight reaches 0


class LoRAManager:
    def __init__(self, cfg: LoRAConfig, runtime: LoRARuntime, model: LlamaModel, base_name: str,
                 dtype: torch.dtype, device: torch.device, stats: Optional[StatsRecorder] = None,
                 args: Optional[ModelArgs] = None, tp: Optional["AdapterSync"] = None,
                 read_delay_s: float = 0.0, on_retire: Optional[Callable[[str], None]] = None,
                 on_read_done: Optional[Callable[[], None]] = None) -> None:
        # runtime: lora.* with auto resolved for this device at start (engine/runtime.py);
        # read_delay_s: debug.fault_injection_read_delay_s; on_retire(key): a key was unloaded or
        # replaced, and again when its last request ends (the prefix cache drops its blocks);
        # on_read_done: called on a reader thread whenever a background read ends (the engine's
        # Doorbell.ring, which wakes an idle loop).
        self.cfg = cfg
        self.on_retire = on_retire
        self.read_delay_s = read_delay_s
        # Loads (disk -> cpu, cpu -> gpu) and evictions of both tiers, for metrics.
        self.stats = stats if stats is not None else StatsRecorder()
        # The full model's shapes (adapters are checked against them); under tensor parallelism
        # `model` is rank 0's shard and `tp` mirrors every load, fill and drop on the other ranks.
        self.args = args if args is not None else model.args
        self.tp: AdapterSync | SingleRankSync = tp if tp is not None else SingleRankSync()
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
        self.backend = runtime.backend
        aside = runtime.decode_side_stream
        self.ctx: LoRAContext = apply_lora(
            model, cfg.resolved_targets(), cfg.max_loras_per_batch, cfg.max_lora_rank, self.backend,
            cfg.max_chunk_size, runtime.sorted_decode, prefill_gemm=runtime.prefill_gemm, decode_aside=aside,
            side_stream=torch.cuda.Stream(device) if aside and device.type == "cuda" else None)
        self.slot_ranks = [0] * cfg.max_loras_per_batch
        # Overlap loading: background cold reads, and on CUDA side-stream copies (module docstring).
        self.reader: Optional[BackgroundReader[Weights]] = None
        self.copier = None
        if cfg.overlap_loading:
            self.reader = BackgroundReader(cfg.loader_threads, on_done=on_read_done)
            if device.type == "cuda":
                from appliance.lora.copier import CudaOps, SlotCopier
                from appliance.lora.staging import SlotImage, StagingPool

                # The only page-locked memory of adapter loading, allocated now: the CPU tier is pageable.
                image = SlotImage(self.ctx)
                self.copier = SlotCopier(image, StagingPool(cfg.loader_threads, image.numel, image.dtype, pin=True),
                                         CudaOps(device))
        # Remote adapter paths (s3://, hf://): allowlist, fetch, disk cache (lora/sources/); the fetch
        # itself in worker processes with lora.fetch_in_subprocess.
        workers = None
        if cfg.fetch_in_subprocess and cfg.allowed_sources:
            from appliance.lora.sources.worker import FetchWorkers

            workers = FetchWorkers(cfg, cfg.loader_threads, timeout_s=3 * cfg.fetch_timeout_s + 60)
        self.sources = AdapterSources(cfg, workers)

    # ------------------------------------------------------------------ admin operations
    def prepare(self, path: str) -> PreparedLoad:
        """Read the adapter at `path` once, validate it and parse its weights from the same bytes, without
        touching engine state, so it may run on any thread (the admin API runs it on a worker thread: the
        batch keeps running meanwhile). Never raises AdapterError: a refusal is handed to `load`, which
        reports it after its own checks."""
        fetched = None
        try:
            self.sources.check(path)  # a remote URI outside the allowlist: refused before any store call
        except AdapterError as e:
            return PreparedLoad(error=e)
        t0 = time.perf_counter()
        try:
            local, fetched = self.sources.local(path)  # a remote URI: resolved, then the disk cache
        except AdapterError as e:  # the store refused, or the download failed: a failed remote -> disk load
            return PreparedLoad(error=e, fetch_s=time.perf_counter() - t0, fetch_failed=True)
        fetch_s = time.perf_counter() - t0 if fetched is not None and fetched.downloaded else None
        try:
            spec, files = read_adapter(local, self.cfg, self.args)
        except AdapterError as e:
            return PreparedLoad(error=shown_as_source(e, fetched), fetch_s=fetch_s)
        if fetched is not None:
            spec = replace(spec, source=fetched.source, revision=fetched.revision)
        try:
            weights = adapter_weights(spec, files, self.dtype)
        except AdapterError as e:
            return PreparedLoad(error=e, read_failed=True, read_s=time.perf_counter() - t0, fetch_s=fetch_s)
        return PreparedLoad(spec.path, spec, weights, time.perf_counter() - t0, fetch_s=fetch_s)

    def load(self, name: str, path: str, pinned: bool = False, inplace: bool = False,
             prepared: Optional[PreparedLoad] = None) -> AdapterEntry:
        """Register (or with `inplace`, replace) an adapter; `prepared`: its files already read by
        `prepare` (else they are read here, on the engine thread).

        Every check comes before the first change (names, then files, then the pin), so a refused
        load raises AdapterError / LoRAStateError and leaves registry, slots and CPU tier as they were.
        """
        check_name(name)  # first: a name that can never be registered costs no file read
        old: Optional[AdapterEntry] = None
        if inplace:
            old = self.registry.get(name)  # 404 when unknown
        elif name in self.registry:
            raise LoRAStateError(f"adapter {shown(name)} is already loaded (use load_inplace to replace it)", 409)
        if name == self.base_name:
            raise LoRAStateError(f"adapter name {shown(name)} is the base model's name", 400)
        if prepared is None:
            prepared = self.prepare(path)
        if prepared.fetch_s is not None:  # recorded here, on the engine thread (StatsRecorder is not thread-safe)
            self.stats.load("disk", not prepared.fetch_failed, prepared.fetch_s)
        if prepared.error is not None:
            # A corrupt file fails here, before any change (counted as a failed disk -> cpu load).
            if prepared.read_failed:
                self.stats.load("cpu", False, prepared.read_s)
            raise prepared.error
        assert prepared.resolved is not None and prepared.spec is not None and prepared.weights is not None
        resolved, spec, weights, read_s = prepared.resolved, prepared.spec, prepared.weights, prepared.read_s
        old_key = self.current[name] if old is not None else None
        key = f"{name}@{next(self._key_numbers)}"
        self.tp.read(key, spec)  # every other rank reads its shard; any failure: none keeps it
        try:
            self._claim_pin(key, spec, weights, pinned, old, old_key)
        except Exception:
            self.tp.drop(key)  # refused: the other ranks forget the shard they read
            raise
        fields = dict(path=spec.source or str(resolved), pinned=pinned, checksum=spec.checksum, rank=spec.rank,
                      target_modules=spec.target_modules, base_model_name=spec.base_model_name,
                      revision=spec.revision or "")
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
        """Where a registered adapter's current weights are: "gpu" (a slot), "cpu" (host memory),
        "disk" (read again on its next request) or "remote" (its disk-cache entry evicted: fetched
        again on its next request)."""
        key = self.current[name]
        if self.pool.lookup(key) is not None:
            return "gpu"
        if key in self.host:
            return "cpu"
        spec = self.keys[key].spec
        return "remote" if spec.source is not None and not Path(spec.path).is_dir() else "disk"

    def tier_counts(self) -> dict[str, int]:
        out = {"gpu": 0, "cpu": 0, "disk": 0, "remote": 0}
        for name in self.current:
            out[self.tier(name)] += 1
        return out

    def residency(self) -> tuple[AdapterResidency, ...]:
        """The adapters whose weights are in memory (gpu or cpu tier), sorted by name."""
        out = []
        for name in sorted(self.current):
            tier = self.tier(name)
            if tier in ("gpu", "cpu"):  # in memory; disk and remote are not resident
                entry = self.registry.get(name)
                out.append(AdapterResidency(name, tier, entry.pinned, entry.rank))  # type: ignore[arg-type]
        return tuple(out)

    def set_pinned(self, name: str, pinned: bool) -> AdapterEntry:
        """Pin or unpin a loaded adapter without reloading it (same weights, same key). Pinning takes a
        slot now; refused with nothing changed at the pin limit or with no slot free; same state: no-op.
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
        if st.in_flight == 0:
            self.host.release(key)  # read for requests that were all aborted or failed
            self.pool.unreserve(key)
        if st.retired and st.in_flight == 0:
            self._drop(key)

    # ------------------------------------------------------------------ overlap loading
    def adapter_ready(self, key: str) -> bool:
        """The scheduler's gate with overlap loading: may a request of `key` take a slot now?

        True when its weights are in a slot (copy completed) or in the CPU tier with no slot to take
        ahead. False while they are being read (a read is started if none is in flight) or copied
        into a slot reserved for them: the request waits, reason "load"."""
        slot = self.pool.lookup(key)
        if slot is not None:
            return self.copier is None or self.copier.done(slot)
        if key not in self.host:
            if self.reader is None:
                return True  # no overlap: the slot fill reads it inline
            self.reader.start(key, partial(self._read_cold, self.keys[key].spec))
            return False
        if self.copier is None:
            return True  # CPU: the slot fill copies synchronously (the copier's CPU twin)
        got = self.pool.reserve(key)
        if got is None:
            return True  # no slot free or evictable: the request waits for a slot as usual
        self._fill_slot(got.slot, key, self.keys[key].spec, self.host.get(key))
        return self.copier.done(got.slot)

    def poll_loads(self) -> dict[str, str]:
        """Collect the background reads finished since the last call (engine thread, start of a step):
        weights go into the CPU tier, failures come back as key -> why (the engine fails the waiting
        requests of those keys; their next request reads the files again). Also records the device
        durations of completed side-stream copies."""
        failed: dict[str, str] = {}
        if self.copier is not None:
            for d in self.copier.finished_durations():
                self.stats.load("gpu", True, d)
            for slot, key, why in self.copier.failures():
                self.stats.load("gpu", False, 0.0)
                if key in self.keys and self.pool.lookup(key) == slot:
                    self.load_failed(key)  # the slot holds no valid weights: its next request copies again
                    failed[key] = why
        if self.reader is None:
            return failed
        for o in self.reader.poll():
            self.stats.load("cpu", o.ok, o.duration_s)
            if o.key not in self.keys:
                continue  # unloaded or replaced, and its requests are gone: nobody needs these weights
            if not o.ok:
                failed[o.key] = str(o.result)
                log.error("adapter %r: background read failed: %s", self.name_of(o.key), o.result)
            else:
                if o.key not in self.host:  # (a pin may have read it inline meanwhile)
                    self.host.put(o.key, o.result)  # type: ignore[arg-type]
                self.host.hold(o.key)  # until its weights reach a slot (CPU tier docstring)
        return failed

    def loads_in_flight(self) -> tuple[int, int]:
        """(background reads not yet polled, side-stream copies not yet completed)."""
        return (self.reader.in_flight if self.reader is not None else 0,
                self.copier.in_flight if self.copier is not None else 0)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.shutdown()
        if self.copier is not None:
            self.copier.close()
        self.sources.close()

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
                if self.copier is not None and (err := self.copier.enqueued(slot)) is not None:
                    raise AdapterError(f"copying it into a GPU slot failed: {err}")  # this step uses the slot
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
        self.host.release(key)  # read for its requests, now on its way to their slot
        if self.copier is not None:
            # Queued for the copy thread (lora/copier.py): the engine thread only checks the shapes. The
            # duration is recorded once its events completed (poll_loads), a refusal right here.
            copier = self.copier
            self._timed("gpu", lambda: (check_adapter_fits(self.ctx, weights), copier.copy(slot, key, weights)),
                        record_ok=False)
            self.slot_ranks[slot] = spec.rank
            return

        def copy() -> None:
            load_adapter_into_slot(self.ctx, slot, self.tp.shard(weights))
            self.tp.fill(slot, key)  # AdapterError when another rank fails: this slot is not valid
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copy's real duration, not its launch

        self._timed("gpu", copy)
        self.slot_ranks[slot] = spec.rank

    def step_slots(self, seg_keys: list[Optional[str]]) -> list[int]:
        """The slot of each segment's key (-1 = base) for the step about to run; the device waits for
        side-stream copies into those slots still running (no host sync). Every step path calls this:
        begin_step and the static decode step (engine/cuda_graph.py)."""
        slots = [-1 if k is None else self.pool.lookup(k) for k in seg_keys]
        if any(s is None for s in slots):
            raise RuntimeError("a scheduled adapter has no slot")
        if self.copier is not None:
            self.copier.wait([s for s in slots if s != -1])  # type: ignore[misc]
        return slots  # type: ignore[return-value]

    def begin_step(self, seg_lens: list[int], seg_keys: list[Optional[str]]) -> Optional[LoRAStepLayout]:
        """Set the step's LoRABatchInfo; returns its layout (None: no adapter token) for other TP ranks."""
        return self.use_layout(seg_lens, self.step_slots(seg_keys))

    def use_layout(self, seg_lens: list[int], slots: list[int]) -> Optional[LoRAStepLayout]:
        """Set the step's LoRABatchInfo from each segment's slot (-1 = base); also the start-up warm-up's
        synthetic steps (engine/warmup.py), which name slots directly."""
        layout = None if all(s == -1 for s in slots) else LoRAStepLayout(
            list(seg_lens), list(slots), list(self.slot_ranks))
        self.ctx.info = None if layout is None else LoRABatchInfo.from_layout(
            layout, self.device, self.backend, self.cfg.max_chunk_size)
        return layout

    # ------------------------------------------------------------------ internals
    def _read_cold(self, spec: AdapterSpec) -> Weights:
        """A cold read: files re-read through descriptors confined to lora.adapter_roots (they may have
        been swapped for symlinks since), revalidated and checksum-checked. Touches no engine state."""
        if self.read_delay_s > 0:
            from appliance.telemetry.faults import slow_read

            slow_read(self.read_delay_s)
        if spec.source is not None:  # its disk-cache entry may have been evicted since: fetched again
            spec = replace(spec, path=self.sources.refresh(spec.source, spec.path))
        return load_adapter_weights(spec, self.dtype, self.cfg, self.args)

    def _read_weights(self, key: str) -> Weights:
        """A cold read on the engine thread (CPU tier miss without overlap loading, or an admin pin)."""
        spec = self.keys[key].spec
        return self._timed("cpu", lambda: self._read_cold(spec))

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
        if self.on_retire is not None:
            self.on_retire(key)
        if st.in_flight == 0:
            self._drop(key)

    def _drop(self, key: str) -> None:
        if self.on_retire is not None:
            self.on_retire(key)  # blocks its last requests cached after the retire
        slot = self.pool.lookup(key)
        if slot is not None:
            self.pool.remove(key)  # also for pinned keys: unloading ends the pin
            self.slot_ranks[slot] = 0
        if key in self.host:
            self.host.drop(key)
        del self.keys[key]
        self.tp.drop(key)
