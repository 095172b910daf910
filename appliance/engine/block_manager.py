"""The paged KV cache's allocator: fixed-size blocks, per-sequence block tables, ref counts.

Pure Python: the model runner owns the tensors, this class only hands out block indices. Ref counts
let several sequences share a block: the parallel samples of one prompt (`n`) share its full blocks
(`share`), and with prefix caching (`engine.enable_prefix_caching`, engine/prefix_cache.py) any
sequence takes the cached full blocks of its prefix (`match` then `allocate(..., cached)`). A block is
free again when its last owner frees it; a cached one stays findable until a fresh block is needed.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence as Seq

from appliance.engine.prefix_cache import PrefixCache, block_hash, root_hash
from appliance.engine.sequence import Sequence
from appliance.telemetry.stats import StatsRecorder


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 stats: Optional[StatsRecorder] = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # blocks holding nothing worth a hit
        self._refs = [0] * num_blocks
        self.cache: Optional[PrefixCache] = PrefixCache() if enable_caching else None
        self.stats = stats if stats is not None else StatsRecorder()

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: plain free ones plus idle cached ones (evicted on demand)."""
        return len(self._free) + (self.cache.num_idle if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a reusable prefix, held by a sequence or idle."""
        return 0 if self.cache is None else len(self.cache)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def blocks_needed(self, seq: Sequence, num_tokens: int, cached: Seq[int] = ()) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have cache slots; `cached`
        (from `match`) are blocks it will take from the prefix cache instead of fresh ones."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(cached))

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: Seq[int] = ()) -> bool:
        # An idle cached block taken as a hit stops being available to anyone else.
        idle_taken = sum(1 for b in cached if self._refs[b] == 0)
        return self.blocks_needed(seq, num_tokens, cached) <= self.num_free - idle_taken

    def allocate(self, seq: Sequence, num_tokens: int, cached: Seq[int] = ()) -> None:
        """Extend `seq`'s table to `num_tokens` tokens: first the `cached` hits (only for a sequence
        holding no blocks), then fresh blocks (an idle cached block is evicted when none is free)."""
        if not self.can_allocate(seq, num_tokens, cached):
            raise RuntimeError(f"out of KV blocks: need {self.blocks_needed(seq, num_tokens, cached)}, "
                               f"have {self.num_free}")
        if cached:
            assert self.cache is not None and not seq.block_table
            for b in cached:
                if self._refs[b] == 0:
                    self.cache.acquire(b)
                self._refs[b] += 1
                seq.block_table.append(b)
            seq.num_cached_blocks = len(cached)
        for _ in range(self.blocks_needed(seq, num_tokens)):
            if self._free:
                b = self._free.popleft()
            else:
                assert self.cache is not None
                b = self.cache.evict()
                self.stats.events.prefix_cache_evictions += 1
            self._refs[b] = 1
            seq.block_table.append(b)

    def share(self, seq: Sequence, source: Sequence, num_blocks: int) -> None:
        """Give `seq` (holding no blocks) the first `num_blocks` blocks of `source`: full blocks, read only."""
        if seq.block_table or num_blocks > len(source.block_table):
            raise RuntimeError(f"cannot share {num_blocks} blocks of {source.request_id} with {seq.request_id}")
        seq.block_table = source.block_table[:num_blocks]
        for b in seq.block_table:
            self._refs[b] += 1

    def free(self, seq: Sequence) -> None:
        self.cache_computed(seq)
        # Release in reverse: with caching, a sequence's tail is evicted before its head.
        for b in reversed(seq.block_table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self.cache is not None and self.cache.is_cached(b):
                    self.cache.release(b)
                else:
                    self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
        seq.block_table = []
        seq.num_cached_blocks = 0

    # ------------------------------------------------------------------ prefix caching
    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks of `seq`'s longest cached prefix, for a sequence that holds no blocks. At
        most the full blocks before its last token: that token is always computed (its logits)."""
        if self.cache is None or seq.block_table:
            return []
        n = min(seq.num_tokens - 1, seq.num_known_tokens) // self.block_size
        hits = []
        for h in self._hashes(seq, n):
            b = self.cache.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def cache_computed(self, seq: Sequence) -> None:
        """Offer `seq`'s full blocks whose K/V are computed (and whose tokens are known on the host) to
        the cache; call after each step (Scheduler.after_step) and on free."""
        if self.cache is None:
            return
        n = min(seq.num_computed_tokens, seq.num_known_tokens, len(seq.block_table) * self.block_size)
        full = n // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            self.cache.insert(seq.block_table[i], hashes[i], seq.adapter)
        seq.num_cached_blocks = full

    def drop_adapter(self, adapter: str) -> None:
        """An adapter key was unloaded or reloaded: its cached blocks can never hit again, free them."""
        if self.cache is not None:
            self._free.extend(self.cache.drop_scope(adapter))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of `seq`'s first `num_blocks` full blocks (kept on the sequence: its tokens
        never change, so preemption keeps them)."""
        hs, bs = seq.block_hashes, self.block_size
        if len(hs) < num_blocks:
            tokens = seq.token_slice(len(hs) * bs, num_blocks * bs)
            parent = hs[-1] if hs else root_hash(seq.adapter, seq.params.cache_salt)
            for i in range(num_blocks - len(hs)):
                parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
                hs.append(parent)
        return hs[:num_blocks]
