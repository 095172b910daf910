"""Automatic prefix caching: which KV blocks hold a known prefix, and which of them may be reused.

A full block is named by a hash chain: sha256 over its parent block's hash and its token ids, the
chain rooted in the sequence's scope (adapter key and cache salt). Two sequences share a block only
when everything before it and in it is equal under the same adapter weights and salt: the adapter key
("name@N", N never reused, lora/manager.py) changes with every load and in-place reload, so a reload
never meets the old weights' KV. sha256 rather than Python's hash: a collision would serve another
prefix's KV. Blocks no sequence holds stay cached in an LRU and are evicted (oldest first; a
sequence's blocks are released leaf first, so its tail goes before its head) only when a fresh block is
needed. Pure Python; the block manager (engine/block_manager.py) owns ref counts and the free list.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Optional, Sequence

BlockHash = bytes


def root_hash(adapter: Optional[str], salt: Optional[str]) -> BlockHash:
    """The chain's root for one scope: base model (adapter None) requests without a salt share one."""
    return hashlib.sha256(repr(("appliance-prefix-v1", adapter, salt)).encode()).digest()


def block_hash(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCache:
    """hash -> block for full, computed blocks, by scope (for invalidation), plus the LRU of the cached
    blocks that no sequence holds (their ref count is 0: free, but still worth a hit)."""

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._scope_of: dict[int, Optional[str]] = {}
        self._by_scope: dict[Optional[str], set[int]] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = evicted first

    def __len__(self) -> int:
        return len(self._by_hash)

    @property
    def num_idle(self) -> int:
        """Cached blocks no sequence holds (counted as free by the block manager)."""
        return len(self._lru)

    def lookup(self, h: BlockHash) -> Optional[int]:
        return self._by_hash.get(h)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_idle(self, block: int) -> bool:
        return block in self._lru

    def insert(self, block: int, h: BlockHash, scope: Optional[str]) -> bool:
        """Name `block` by `h`; False (nothing changes) when `h` already names another block or the
        block already has a name (two sequences computed the same prefix: the first one wins)."""
        if h in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        self._scope_of[block] = scope
        self._by_scope.setdefault(scope, set()).add(block)
        return True

    def acquire(self, block: int) -> None:
        """A sequence takes an idle cached block: it is no longer evictable."""
        self._lru.pop(block, None)

    def release(self, block: int) -> None:
        """The last holder let `block` go: keep it, most recently used last."""
        self._lru[block] = None

    def evict(self) -> int:
        """Forget the least recently used idle block and return it (now a plain free block)."""
        block, _ = self._lru.popitem(last=False)
        self._forget(block)
        return block

    def drop_scope(self, scope: Optional[str]) -> list[int]:
        """Forget every block of `scope` (an unloaded or reloaded adapter); returns the idle ones, which
        are plain free blocks now. Held ones stay with their sequences and are freed as uncached."""
        idle = []
        for block in sorted(self._by_scope.get(scope, ())):
            if block in self._lru:
                del self._lru[block]
                idle.append(block)
            self._forget(block)
        return idle

    def _forget(self, block: int) -> None:
        del self._by_hash[self._hash_of.pop(block)]
        scope = self._scope_of.pop(block)
        members = self._by_scope[scope]
        members.discard(block)
        if not members:
            del self._by_scope[scope]
