"""SlotPool: which victim lru and fifo evict, what is never evicted, pins, and the drain rule."""

import pytest

from appliance.lora.pool import Acquired, ResidentView, SlotPool, choose_drain_victim
from appliance.lora.registry import LoRAStateError


def use(pool: SlotPool, name: str) -> Acquired:
    """One request of `name` runs and finishes."""
    got = pool.acquire(name)
    assert got is not None
    pool.release(name)
    return got


def test_acquire_loads_once_then_hits():
    pool = SlotPool(2, "lru")
    assert pool.acquire("a") == Acquired(0, needs_load=True, evicted=None)
    assert pool.acquire("a") == Acquired(0, needs_load=False, evicted=None)
    assert pool.acquire("b") == Acquired(1, needs_load=True, evicted=None)
    assert pool.lookup("a") == 0 and pool.lookup("b") == 1 and pool.lookup("c") is None
    assert pool.running("a") == 2
    assert pool.release("a") == 1


def sequence_where_policies_differ(policy: str) -> Acquired | None:
    # a loaded first, b second; then a is used again, so b is the least recently used but a the oldest.
    pool = SlotPool(2, policy)
    use(pool, "a")
    use(pool, "b")
    use(pool, "a")
    return pool.acquire("c")


def test_lru_and_fifo_choose_different_victims():
    assert sequence_where_policies_differ("lru") == Acquired(1, needs_load=True, evicted="b")
    assert sequence_where_policies_differ("fifo") == Acquired(0, needs_load=True, evicted="a")


def test_release_counts_as_use_for_lru():
    # b acquired after a, but a's request finished last: a is more recently used.
    pool = SlotPool(2, "lru")
    pool.acquire("a")
    pool.acquire("b")
    pool.release("b")
    pool.release("a")
    assert pool.acquire("c").evicted == "b"


def test_fifo_ignores_use_and_goes_by_load_order():
    pool = SlotPool(3, "fifo")
    for n in "abc":
        use(pool, n)
    use(pool, "a")
    assert pool.acquire("d").evicted == "a"
    pool.release("d")
    assert pool.acquire("e").evicted == "b"
    pool.release("e")
    assert pool.acquire("f").evicted == "c"
    pool.release("f")
    assert pool.acquire("g").evicted == "d"  # d was loaded before e and f
    assert pool.stats().evictions == 4


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_running_adapter_is_never_evicted(policy):
    pool = SlotPool(2, policy)
    pool.acquire("a")  # running, and the lru/fifo choice if it were idle
    use(pool, "b")
    assert pool.acquire("c").evicted == "b"
    assert pool.lookup("a") == 0


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_acquire_returns_none_when_all_busy_and_changes_nothing(policy):
    pool = SlotPool(2, policy)
    pool.acquire("a")
    pool.acquire("b")
    before = (pool.residents(), pool.stats())
    assert pool.acquire("c") is None
    assert (pool.residents(), pool.stats()) == before
    pool.release("b")
    assert pool.acquire("c") == Acquired(1, needs_load=True, evicted="b")


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_pinned_adapter_is_never_evicted(policy):
    pool = SlotPool(2, policy)
    assert pool.pin("p") == Acquired(0, needs_load=True, evicted=None)
    assert pool.running("p") == 0  # the pin alone holds the slot
    for name in "abcde":
        got = use(pool, name)
        assert got.slot == 1 and got.evicted != "p"
    assert pool.lookup("p") == 0
    pool.acquire("x")
    assert pool.acquire("y") is None  # p idle but pinned, x running


def test_pin_resident_and_unpin_makes_it_evictable_again():
    pool = SlotPool(2, "lru")
    use(pool, "a")
    assert pool.pin("a") == Acquired(0, needs_load=False, evicted=None)
    assert pool.pin("a") == Acquired(0, needs_load=False, evicted=None)  # idempotent
    use(pool, "b")
    assert pool.acquire("c").evicted == "b"
    pool.release("c")
    pool.unpin("a")
    assert pool.acquire("d").evicted == "a"  # a is now the least recently used, unpinned
    with pytest.raises(LoRAStateError) as e:
        pool.unpin("d")
    assert e.value.status == 409


def test_pin_non_resident_evicts_by_policy():
    pool = SlotPool(3, "lru")
    use(pool, "a")
    use(pool, "b")
    use(pool, "c")
    use(pool, "a")
    assert pool.pin("p") == Acquired(1, needs_load=True, evicted="b")


def test_pin_without_a_free_or_evictable_slot_is_409_and_changes_nothing():
    pool = SlotPool(2, "lru")
    pool.acquire("a")
    pool.acquire("b")
    before = (pool.residents(), pool.stats())
    with pytest.raises(LoRAStateError) as e:
        pool.pin("p")
    assert e.value.status == 409 and "retry" in str(e.value)
    assert (pool.residents(), pool.stats()) == before and pool.lookup("p") is None


def test_pin_limit_is_slots_minus_one():
    pool = SlotPool(3, "lru")
    pool.pin("a")
    pool.pin("b")
    before = (pool.residents(), pool.stats())
    with pytest.raises(LoRAStateError) as e:
        pool.pin("c")
    assert e.value.status == 400 and "at most 2 of 3" in str(e.value)
    assert (pool.residents(), pool.stats()) == before
    use(pool, "d")
    with pytest.raises(LoRAStateError):
        pool.pin("d")  # resident, but the limit holds for it too
    assert pool.stats().pinned == 2 and pool.lookup("c") is None
    with pytest.raises(LoRAStateError):
        SlotPool(1, "lru").pin("a")  # one slot: nothing may be pinned


def test_release_without_acquire_is_an_error():
    pool = SlotPool(1, "lru")
    with pytest.raises(LoRAStateError):
        pool.release("a")
    use(pool, "a")
    with pytest.raises(LoRAStateError) as e:
        pool.release("a")
    assert "without a matching acquire" in str(e.value)


def test_remove_only_when_idle():
    pool = SlotPool(2, "lru")
    pool.acquire("a")
    with pytest.raises(LoRAStateError) as e:
        pool.remove("a")
    assert e.value.status == 409 and "1 request(s) still running" in str(e.value)
    assert pool.release("a") == 0
    assert pool.remove("a") == 0
    assert pool.lookup("a") is None and pool.num_free() == 2
    with pytest.raises(LoRAStateError) as e:
        pool.remove("a")
    assert e.value.status == 404
    pool.pin("p")
    assert pool.remove("p") == 0  # unloading a pinned adapter frees its pin too
    assert pool.stats().pinned == 0
    assert pool.stats().evictions == 0  # removal is not an eviction


def test_stats_per_slot_view():
    pool = SlotPool(3, "fifo")
    pool.pin("p")
    pool.acquire("a")
    pool.acquire("a")
    s = pool.stats()
    assert (s.slots, s.used, s.pinned, s.evictions) == (3, 2, 1, 0)
    assert [(v.slot, v.adapter, v.pinned, v.running) for v in s.per_slot] == [
        (0, "p", True, 0), (1, "a", False, 2), (2, None, False, 0)]


def test_constructor_checks():
    with pytest.raises(ValueError):
        SlotPool(0, "lru")
    with pytest.raises(ValueError):
        SlotPool(2, "random")


# -- drain rule --------------------------------------------------------------------------------------

def rv(name: str, running: int, last_used: int, pinned: bool = False, slot: int = 0) -> ResidentView:
    return ResidentView(name, slot, pinned, running, loaded_at=0, last_used=last_used)


BUSY = [rv("a", 3, last_used=5), rv("b", 1, last_used=9), rv("c", 1, last_used=7),
        rv("p", 0, last_used=1, pinned=True)]


def test_drain_picks_fewest_running_then_lru_never_pinned():
    assert choose_drain_victim(BUSY, {"x": 0.0}, now=10.0, threshold_s=5.0) == "c"
    # p has the fewest running (0) but is pinned; c and b tie at 1, c was used less recently.


def test_drain_needs_a_wait_past_the_threshold():
    assert choose_drain_victim(BUSY, {"x": 6.0}, now=10.0, threshold_s=5.0) is None
    assert choose_drain_victim(BUSY, {"x": 5.0}, now=10.0, threshold_s=5.0) is None  # not longer
    assert choose_drain_victim(BUSY, {}, now=10.0, threshold_s=5.0) is None
    assert choose_drain_victim(BUSY, {"x": 0.0}, now=10.0, threshold_s=0) is None  # rule off


def test_drain_ignores_waiters_of_resident_adapters():
    assert choose_drain_victim(BUSY, {"a": 0.0}, now=10.0, threshold_s=5.0) is None


def test_drain_not_needed_when_a_resident_is_evictable():
    idle = BUSY + [rv("d", 0, last_used=8)]
    assert choose_drain_victim(idle, {"x": 0.0}, now=10.0, threshold_s=5.0) is None


def test_drain_keeps_the_current_victim():
    assert choose_drain_victim(BUSY, {"x": 0.0}, 10.0, 5.0, current="a") == "a"
    # a current victim that is no longer a candidate (pinned, or gone) is replaced
    assert choose_drain_victim(BUSY, {"x": 0.0}, 10.0, 5.0, current="p") == "c"
    assert choose_drain_victim(BUSY, {"x": 0.0}, 10.0, 5.0, current="gone") == "c"


def test_pool_drain_victim():
    pool = SlotPool(3, "lru")
    pool.pin("p")
    pool.acquire("a")
    assert pool.drain_victim({"x": 0.0}, now=10.0, threshold_s=1.0) is None  # slot 2 free
    pool.acquire("b")
    pool.acquire("b")
    assert pool.acquire("x") is None
    assert pool.drain_victim({"x": 0.0}, now=10.0, threshold_s=1.0) == "a"
    pool.release("a")  # drained: x can take a's slot now
    assert pool.drain_victim({"x": 0.0}, now=10.0, threshold_s=1.0) is None
    assert pool.acquire("x") == Acquired(1, needs_load=True, evicted="a")


def test_reserve_places_without_a_running_request_and_stays_evictable() -> None:
    p = SlotPool(2, "lru")
    assert p.acquire("a") is not None
    got = p.reserve("b")
    assert got == Acquired(1, needs_load=True, evicted=None) and p.running("b") == 0
    assert p.reserve("b") is None  # resident already: nothing changes
    assert p.acquire("b") == Acquired(1, needs_load=False, evicted=None)  # its request finds the weights
    p.release("b")
    assert p.reserve("c") == Acquired(1, needs_load=True, evicted="b")  # idle b leaves; busy a stays
    p.acquire("c")
    assert p.reserve("d") is None  # both slots busy: refused, nothing changed
    assert [r.name for r in p.residents()] == ["a", "c"]


def test_a_reservation_is_not_evicted_by_another_reservation() -> None:
    p = SlotPool(1, "lru")
    assert p.reserve("a") is not None
    assert p.reserve("b") is None  # a's copy is not thrown away for b's
    assert p.acquire("b") == Acquired(0, needs_load=True, evicted="a")  # a request may still take it
    p.release("b")
    p.reserve("c")
    p.unreserve("c")  # c's requests went away: an ordinary idle resident again
    assert p.reserve("d") == Acquired(0, needs_load=True, evicted="c")
