"""The GPU slot pool's policy: which adapter sits in which slot, and who leaves when a slot is needed.

Pure Python; the runner copies weights into slot `i` when `acquire`/`pin` answer `needs_load=True`.
An adapter holds its slot while any of its requests runs; the victim is an unpinned, idle adapter
(`lru` or `fifo`), else the request waits. At most num_slots - 1 adapters are pinned, so nothing
starves for good. Time is an event counter, not the clock, so ordering is exact and tests deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Optional, Sequence

from appliance.lora.registry import LoRAStateError

Policy = Literal["lru", "fifo"]


@dataclass(frozen=True)
class Acquired:
    slot: int
    needs_load: bool  # True: the runner must copy the adapter's weights into `slot` before it runs
    evicted: str | None  # adapter that held `slot` before (its weights are overwritten), if any


@dataclass(frozen=True)
class ResidentView:
    """One resident adapter, as the drain rule and /v1/adapters see it."""

    name: str
    slot: int
    pinned: bool
    running: int  # requests currently holding the slot
    loaded_at: int  # counter value when it got the slot (fifo order)
    last_used: int  # counter value of the last acquire or release (lru order)


@dataclass(frozen=True)
class SlotView:
    slot: int
    adapter: str | None
    pinned: bool
    running: int


@dataclass(frozen=True)
class PoolStats:
    slots: int
    used: int
    pinned: int
    evictions: int  # total since start
    per_slot: tuple[SlotView, ...]


@dataclass
class _Resident:
    slot: int
    loaded_at: int
    last_used: int
    pinned: bool = False
    running: int = 0
    reserved: bool = False  # placed by `reserve`, no request has acquired it yet


class SlotPool:
    """Not thread-safe: the engine's scheduler owns it and calls it from the engine loop only."""

    def __init__(self, num_slots: int, policy: Policy,
                 on_evict: Optional[Callable[[str], None]] = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if policy not in ("lru", "fifo"):
            raise ValueError(f"eviction policy must be 'lru' or 'fifo', got {policy!r}")
        self.num_slots = num_slots
        self.policy: Policy = policy
        self._slots: list[str | None] = [None] * num_slots
        self._res: dict[str, _Resident] = {}
        self._clock = 0
        self.evictions = 0
        # Called with the evicted adapter's name on every eviction (the engine counts them for metrics).
        self._on_evict = on_evict

    # -- queries ---------------------------------------------------------------------------------

    def lookup(self, name: str) -> int | None:
        r = self._res.get(name)
        return None if r is None else r.slot

    def running(self, name: str) -> int:
        r = self._res.get(name)
        return 0 if r is None else r.running

    def num_free(self) -> int:
        return self.num_slots - len(self._res)

    def residents(self) -> list[ResidentView]:
        return [ResidentView(n, r.slot, r.pinned, r.running, r.loaded_at, r.last_used)
                for n, r in sorted(self._res.items(), key=lambda kv: kv[1].slot)]

    def stats(self) -> PoolStats:
        per_slot = []
        for i, name in enumerate(self._slots):
            r = self._res.get(name) if name is not None else None
            per_slot.append(SlotView(i, name, r.pinned if r else False, r.running if r else 0))
        return PoolStats(slots=self.num_slots, used=len(self._res),
                         pinned=sum(r.pinned for r in self._res.values()),
                         evictions=self.evictions, per_slot=tuple(per_slot))

    # -- requests --------------------------------------------------------------------------------

    def acquire(self, name: str) -> Acquired | None:
        """One more running request of `name`. None: no slot is free or evictable right now; nothing
        changed and the caller keeps the request waiting (other requests still proceed)."""
        r = self._res.get(name)
        if r is not None:
            r.running += 1
            r.reserved = False
            r.last_used = self._tick()
            return Acquired(r.slot, needs_load=False, evicted=None)
        got = self._place(name)
        if got is not None:
            self._res[name].running = 1
        return got

    def release(self, name: str) -> int:
        """One request of `name` finished (or was preempted). Returns the requests still running, so an
        unload waiting for in-flight requests knows when it may `remove`."""
        r = self._res.get(name)
        if r is None or r.running == 0:
            # Always a bookkeeping bug in the caller: a release without its acquire.
            raise LoRAStateError(f"release({name!r}) without a matching acquire "
                                 f"({'not resident' if r is None else 'no running requests'})", 409)
        r.running -= 1
        r.last_used = self._tick()
        return r.running

    # -- admin -----------------------------------------------------------------------------------

    def pin(self, name: str) -> Acquired:
        """Pin `name` to a slot. A non-resident adapter first gets a slot by the same rule as `acquire`
        (needs_load=True: the caller loads it), but with no running request: the pin alone holds it.
        Pinning a pinned adapter is a no-op that reports its slot. Unlike `acquire`, no slot free or
        evictable is an error (409, nothing changed): an admin call answers now instead of queueing."""
        r = self._res.get(name)
        if r is not None and r.pinned:
            return Acquired(r.slot, needs_load=False, evicted=None)
        limit = self.num_slots - 1
        pinned = sum(x.pinned for x in self._res.values())
        if pinned >= limit:
            raise LoRAStateError(f"cannot pin {name!r}: at most {limit} of {self.num_slots} GPU "
                                 f"slots may be pinned (lora.max_loras_per_batch - 1), "
                                 f"{pinned} already are", 400)
        if r is not None:
            r.pinned = True
            return Acquired(r.slot, needs_load=False, evicted=None)
        got = self._place(name)
        if got is None:
            raise LoRAStateError(f"cannot pin {name!r} now: all {self.num_slots} GPU slots hold adapters "
                                 "that are pinned or have running requests; retry when one finishes", 409)
        self._res[name].pinned = True
        return got

    def reserve(self, name: str) -> Acquired | None:
        """Give non-resident `name` a slot ahead of its requests (overlap loading), by `acquire`'s rule.
        No other reservation evicts it until a request acquires it, so waiting adapters cannot evict
        each other's fresh copies. None: no slot, or already resident; nothing changed."""
        if name in self._res:
            return None
        got = self._place(name, for_reservation=True)
        if got is not None:
            self._res[name].reserved = True
        return got

    def unreserve(self, name: str) -> None:
        """Its requests are gone before acquiring the reserved slot: an ordinary idle resident again."""
        r = self._res.get(name)
        if r is not None:
            r.reserved = False

    def unpin(self, name: str) -> None:
        """The adapter stays resident and becomes evictable once it has no running request."""
        r = self._res.get(name)
        if r is None or not r.pinned:
            raise LoRAStateError(f"unpin({name!r}): adapter is not pinned", 409)
        r.pinned = False

    def remove(self, name: str) -> int:
        """Unload `name` from its slot (pinned or not) and free the slot. Returns the freed slot."""
        r = self._res.get(name)
        if r is None:
            raise LoRAStateError(f"remove({name!r}): adapter holds no GPU slot", 404)
        if r.running:
            raise LoRAStateError(f"cannot remove {name!r} from slot {r.slot}: {r.running} "
                                 "request(s) still running on it; remove after they finish", 409)
        del self._res[name]
        self._slots[r.slot] = None
        return r.slot

    # -- drain -----------------------------------------------------------------------------------

    def drain_victim(self, waiting_since: Mapping[str, float], now: float, threshold_s: float,
                     current: str | None = None) -> str | None:
        """`choose_drain_victim` over this pool; None while a slot is free (the waiter can just take it)."""
        if self.num_free():
            return None
        return choose_drain_victim(self.residents(), waiting_since, now, threshold_s, current=current)

    # -- internals -------------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _place(self, name: str, for_reservation: bool = False) -> Acquired | None:
        """Give non-resident `name` a free slot, else evict a victim's. Resident with running 0."""
        evicted: str | None = None
        if None in self._slots:
            slot = self._slots.index(None)  # lowest free slot: deterministic
        else:
            victim = self._victim(spare_reserved=for_reservation)
            if victim is None:
                return None
            slot = self._res.pop(victim).slot
            evicted = victim
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(victim)
        t = self._tick()
        self._slots[slot] = name
        self._res[name] = _Resident(slot=slot, loaded_at=t, last_used=t)
        return Acquired(slot, needs_load=True, evicted=evicted)

    def _victim(self, spare_reserved: bool = False) -> str | None:
        candidates = [(n, r) for n, r in self._res.items()
                      if r.running == 0 and not r.pinned and not (spare_reserved and r.reserved)]
        if not candidates:
            return None
        key = (lambda nr: nr[1].last_used) if self.policy == "lru" else (lambda nr: nr[1].loaded_at)
        return min(candidates, key=key)[0]


def choose_drain_victim(residents: Sequence[ResidentView], waiting_since: Mapping[str, float],
                        now: float, threshold_s: float, *, current: str | None = None) -> str | None:
    """The drain rule (lora.drain_wait_threshold_s): the resident adapter whose new admissions stop so
    its slot frees for a starving one, or None.

    None when the rule is off, no non-resident adapter (waiting_since: name -> oldest wait) waited past
    threshold_s, or some resident is already evictable. Else the unpinned resident with the fewest
    running requests, then least recently used; `current` is kept while still a candidate, so the
    drain never hops between adapters without completing.
    """
    if threshold_s <= 0:
        return None
    resident = {r.name for r in residents}
    if not any(now - t > threshold_s for n, t in waiting_since.items() if n not in resident):
        return None
    candidates = [r for r in residents if not r.pinned]
    if any(r.running == 0 for r in candidates):
        return None
    if not candidates:
        return None
    for r in candidates:
        if r.name == current:
            return current
    return min(candidates, key=lambda r: (r.running, r.last_used)).name
