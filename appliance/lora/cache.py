"""The CPU tier: at most `capacity` adapters' weights in host memory, least recently used leave first.

Pure policy, generic over the weights type (the loader is passed in). Keys must change whenever the
weights behind a name change (AdapterEntry.cache_key, "<name>@<generation>"), so an in-place reload
can never be served the old weights; the caller drops the old key or lets LRU age it out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar

from appliance.lora.registry import LoRAStateError

T = TypeVar("T")


@dataclass(frozen=True)
class CacheStats:
    entries: int
    capacity: int
    pinned: int
    loads: int  # loader calls that succeeded (misses)
    evictions: int


class HostCache(Generic[T]):
    """Not thread-safe: its owner serialises calls (a miss runs the loader inline)."""

    def __init__(self, capacity: int, loader: Callable[[str], T],
                 on_evict: Optional[Callable[[str], None]] = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._loader = loader
        self._items: OrderedDict[str, T] = OrderedDict()  # oldest use first
        self._pinned: set[str] = set()
        self._held: set[str] = set()  # see `hold`
        self.loads = 0
        self.evictions = 0
        # Called with the key of every entry evicted for capacity (not for `drop`): metrics count them.
        self._on_evict = on_evict

    def get(self, key: str) -> T:
        """The weights for `key`, loaded on a miss; `key` becomes the most recently used.

        A loader exception propagates and the cache is left as it was (nothing evicted, nothing
        counted): the load runs before any bookkeeping changes.
        """
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = self._loader(key)
        self._items[key] = value
        self.loads += 1
        self._evict_over_capacity(keep=key)
        return value

    def put(self, key: str, value: T) -> None:
        """Insert weights the caller already read (a load that validated them first), as the most
        recently used entry; replaces an entry of the same key. Counts as a load."""
        self._items[key] = value
        self._items.move_to_end(key)
        self.loads += 1
        self._evict_over_capacity(keep=key)

    def pin(self, key: str) -> T:
        """Load `key` if needed and keep it in memory until `unpin` or `drop` (pinned adapters)."""
        value = self.get(key)
        self._pinned.add(key)
        return value

    def hold(self, key: str) -> None:
        """Keep `key` from eviction until `release` (or `drop`): weights read in the background for
        requests that have not reached a GPU slot yet. Without it, reads finishing together could evict
        each other before use and be read again, over and over, when more adapters wait than fit."""
        if key not in self._items:
            raise KeyError(f"hold({key!r}): not cached")
        self._held.add(key)

    def release(self, key: str) -> None:
        """End a `hold` (no-op without one); the entry becomes evictable again."""
        if key in self._held:
            self._held.discard(key)
            self._evict_over_capacity(keep=None)

    def unpin(self, key: str) -> None:
        if key not in self._pinned:
            raise LoRAStateError(f"unpin({key!r}): not pinned in the CPU cache", 409)
        self._pinned.discard(key)
        self._evict_over_capacity(keep=None)

    def drop(self, key: str) -> bool:
        """Forget `key` (unload, or the old generation after a reload), pinned or not. Returns whether
        it was cached: an LRU eviction may already have removed it, which is not an error."""
        self._pinned.discard(key)
        self._held.discard(key)
        if key not in self._items:
            return False
        del self._items[key]
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self._items), capacity=self.capacity, pinned=len(self._pinned),
                          loads=self.loads, evictions=self.evictions)

    def _evict_over_capacity(self, keep: str | None) -> None:
        # Soft bound: pinned, held and `keep` (being returned) entries are never evicted, so the cache may
        # stay over capacity rather than break a pin (the config keeps that rare).
        for key in list(self._items):
            if len(self._items) <= self.capacity:
                break
            if key in self._pinned or key in self._held or key == keep:
                continue
            del self._items[key]
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(key)
