"""Prefix caching's control logic in plain Python: the hash chain, sharing, LRU eviction (leaf first),
invalidation by adapter key, cache_salt, and how the scheduler counts cached tokens."""

from __future__ import annotations

from appliance.config.schema import EngineConfig
from appliance.engine.block_manager import BlockManager
from appliance.engine.prefix_cache import PrefixCache, block_hash, root_hash
from appliance.engine.request import SamplingParams
from appliance.engine.scheduler import Scheduler, SchedulerOutput
from appliance.engine.sequence import Sequence


def seq(tokens: list[int], adapter: str | None = None, salt: str | None = None, rid: str = "s") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=100, cache_salt=salt), 0.0, adapter=adapter)


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Admit `s` (taking its cached prefix) and mark its whole prompt computed, as a step would."""
    hits = bm.match(s)
    bm.allocate(s, s.num_tokens, hits)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed(s)
    return s


def test_hash_chain_depends_on_every_earlier_token_and_the_scope() -> None:
    r = root_hash(None, None)
    a = block_hash(block_hash(r, [1, 2]), [3, 4])
    assert a == block_hash(block_hash(r, [1, 2]), [3, 4])
    assert a != block_hash(block_hash(r, [1, 9]), [3, 4])  # same block, other parent
    assert root_hash("x@1", None) not in (r, root_hash("x@2", None), root_hash(None, "x@1"))
    assert root_hash(None, "t1") != root_hash(None, "t2")


def test_same_prefix_shares_full_blocks_and_never_the_last_token() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_caching=True)
    a = computed(bm, seq(list(range(10))))  # blocks 0-3, 4-7 full; 8-9 partial
    b = seq(list(range(10)))
    assert bm.match(b) == a.block_table[:2]
    whole = seq(list(range(8)))  # all full blocks cached: the last token's block is recomputed
    assert bm.match(whole) == a.block_table[:1]
    assert bm.match(seq([0, 1, 2, 3, 99, 5, 6, 7, 8])) == a.block_table[:1]
    assert bm.match(seq(list(range(10)), adapter="x@0")) == []
    assert bm.match(seq(list(range(10)), salt="tenant")) == []
    computed(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_used == 4 and bm.num_cached == 2


def test_freed_cached_blocks_stay_findable_and_are_evicted_lru_leaf_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a = computed(bm, seq([1, 2, 3, 4, 5]))  # 3 blocks, 2 cached
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free == 4 and bm.num_cached == 2
    assert bm.match(seq([1, 2, 3, 4, 5])) == table[:2]
    # One fresh block: the plain free ones go first, so the cached prefix survives.
    c = seq([7, 7, 7])
    bm.allocate(c, 2)
    bm.allocate(c, 4)
    assert bm.match(seq([1, 2, 3, 4, 5])) == table[:2] and bm.stats.events.prefix_cache_evictions == 0
    bm.allocate(c, 6)  # needs an idle cached block: the leaf (3, 4) goes, the head (1, 2) stays
    assert bm.stats.events.prefix_cache_evictions == 1
    assert bm.match(seq([1, 2, 3, 4, 5])) == table[:1]


def test_held_cached_block_is_not_evicted_and_counts_as_used() -> None:
    bm = BlockManager(num_blocks=3, block_size=2, enable_caching=True)
    a = computed(bm, seq([1, 2, 3]))
    bm.free(a)
    b = seq([1, 2, 3])
    hits = bm.match(b)
    assert len(hits) == 1
    assert bm.can_allocate(b, 6, hits) and not bm.can_allocate(b, 8, hits)
    bm.allocate(b, 6, hits)
    assert bm.num_free == 0 and b.num_cached_blocks == 1
    assert not bm.can_allocate(seq([5]), 1)


def test_drop_adapter_forgets_its_blocks_only() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    a = computed(bm, seq([1, 2, 3], adapter="x@0"))
    held = computed(bm, seq([1, 2, 3], adapter="x@0"))  # shares a's block, still running
    base = computed(bm, seq([1, 2, 3]))
    bm.free(a)
    bm.drop_adapter("x@0")
    assert bm.match(seq([1, 2, 3], adapter="x@0")) == [] and bm.match(seq([1, 2, 3])) == base.block_table[:1]
    bm.free(held)  # the shared block returns to the plain free list, not the cache
    bm.free(base)
    assert bm.num_free == 8 and bm.num_cached == 1


def test_prefix_cache_lru_order_and_duplicates() -> None:
    c = PrefixCache()
    assert c.insert(5, b"h5", None) and not c.insert(6, b"h5", None) and not c.insert(5, b"other", None)
    c.insert(6, b"h6", "a@1")
    c.release(6)
    c.release(5)
    assert c.num_idle == 2 and c.evict() == 6 and c.lookup(b"h6") is None
    c.acquire(5)
    assert c.num_idle == 0 and c.lookup(b"h5") == 5


def test_no_caching_keeps_the_old_behaviour() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = computed(bm, seq([1, 2, 3]))
    bm.free(a)
    assert bm.match(seq([1, 2, 3])) == [] and bm.num_cached == 0 and bm.num_free == 4


def step(s: Scheduler, out: SchedulerOutput) -> None:
    samplers = [x.seq for x in out.prefills + out.decodes if x.samples]
    s.after_step(out)
    for q in samplers:
        q.output_token_ids.append(7)


def test_scheduler_takes_only_uncached_tokens_from_the_budget_and_counts_hits() -> None:
    s = Scheduler(EngineConfig(max_num_batched_tokens=12), BlockManager(20, 4, enable_caching=True))
    a = seq(list(range(10)), rid="a")
    s.add(a)
    step(s, s.schedule())  # computes 10 (8 of them in full blocks)
    b, c = seq(list(range(10)) + [50], rid="b"), seq(list(range(10)) + [60], rid="c")
    s.add(b)
    s.add(c)
    out = s.schedule()  # a decodes (1), b and c take 3 each: 8 cached tokens apiece
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.prefills] == [("b", 3), ("c", 3)]
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert s.stats.events.prefix_cache_lookups == [(None, 10, 0), (None, 11, 8), (None, 11, 8)]


def test_preempted_sequence_finds_its_own_blocks_again_and_no_block_leaks() -> None:
    bm = BlockManager(10, 2, enable_caching=True)
    s = Scheduler(EngineConfig(max_num_batched_tokens=64), bm)
    a, b = seq([1, 2, 3, 4, 5], rid="a"), seq(list(range(20, 29)), rid="b")
    s.add(a)
    s.add(b)
    while not s.num_preemptions:
        step(s, s.schedule())
    assert b in s.waiting and b.num_computed_tokens == 0
    s.remove(a)  # a finishes: room for b again
    out = s.schedule()
    (x,) = out.prefills
    _, queried, hit = s.stats.events.prefix_cache_lookups[-1]
    assert x.seq is b and hit > 0 and x.num_new_tokens == queried - hit == b.num_tokens - b.num_computed_tokens
    step(s, out)
    s.remove(b)
    assert bm.num_free == 10 and sum(bm._refs) == 0
