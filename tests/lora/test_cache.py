"""HostCache: LRU over unpinned entries, soft capacity with pins, failed loads change nothing."""

import pytest

from appliance.lora.cache import HostCache
from appliance.lora.registry import LoRAStateError


class Loader:
    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail or set()

    def __call__(self, key: str) -> str:
        if key in self.fail:
            raise FileNotFoundError(f"no adapter at {key}")
        self.calls.append(key)
        return f"weights:{key}"


def state(c: HostCache):
    return [k for k in ("a", "b", "c", "d", "e") if k in c], c.stats()


def test_miss_loads_hit_does_not():
    ld = Loader()
    c = HostCache(2, ld)
    assert c.get("a") == "weights:a"
    assert c.get("a") == "weights:a"
    assert ld.calls == ["a"] and c.stats().loads == 1 and "a" in c


def test_evicts_least_recently_used():
    ld = Loader()
    c = HostCache(2, ld)
    c.get("a")
    c.get("b")
    c.get("a")  # b is now least recently used
    c.get("c")
    assert "b" not in c and "a" in c and "c" in c
    assert c.stats().evictions == 1 and len(c) == 2
    c.get("b")  # re-read from disk
    assert ld.calls == ["a", "b", "c", "b"] and "a" not in c


def test_loader_error_propagates_and_changes_nothing():
    c = HostCache(2, Loader(fail={"bad"}))
    c.get("a")
    c.get("b")
    before = state(c)
    with pytest.raises(FileNotFoundError):
        c.get("bad")
    with pytest.raises(FileNotFoundError):
        c.pin("bad")
    assert state(c) == before and "bad" not in c


def test_pinned_entries_are_never_evicted():
    c = HostCache(2, Loader())
    c.pin("a")
    for k in "bcde":
        c.get(k)
        assert "a" in c
    assert len(c) == 2 and c.stats().pinned == 1


def test_capacity_is_soft_when_pins_fill_it():
    c = HostCache(2, Loader())
    c.pin("a")
    c.pin("b")
    assert c.get("c") == "weights:c"
    assert len(c) == 3  # pins kept, and the entry being returned too
    c.get("d")
    assert "c" not in c and "d" in c and len(c) == 3
    c.unpin("a")  # back under the bound at once: a is the least recently used unpinned entry
    assert "a" not in c and len(c) == 2


def test_unpin_then_evictable_and_unpin_errors():
    c = HostCache(1, Loader())
    c.pin("a")
    c.unpin("a")
    c.get("b")
    assert "a" not in c
    with pytest.raises(LoRAStateError) as e:
        c.unpin("b")
    assert e.value.status == 409


def test_drop():
    c = HostCache(2, Loader())
    c.pin("a")
    assert c.drop("a") is True and "a" not in c and c.stats().pinned == 0
    assert c.drop("a") is False  # already gone (e.g. aged out): not an error
    assert c.stats().evictions == 0


def test_generation_keys_never_return_stale_weights():
    c = HostCache(4, lambda key: {"key": key})
    old = c.get("sql@0")
    new = c.get("sql@1")  # after an in-place reload the caller asks for the new generation
    assert old is not new and new["key"] == "sql@1"
    c.drop("sql@0")
    assert "sql@0" not in c and "sql@1" in c


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        HostCache(0, Loader())


def test_put_inserts_without_loading():
    ld = Loader()
    c = HostCache(2, ld)
    c.get("a")
    c.put("b", "read-by-caller")
    c.put("c", "also")
    assert c.get("b") == "read-by-caller" and ld.calls == ["a"]
    assert "a" not in c and c.stats().loads == 3 and c.stats().evictions == 1


def test_held_entries_are_not_evicted_until_released() -> None:
    c = HostCache(1, lambda k: k.upper())
    c.put("a", "A")
    c.hold("a")
    c.put("b", "B")  # over capacity, but a is held (read for requests not yet in a slot)
    assert "a" in c and "b" in c
    c.release("a")  # a reached its slot: evictable again, and the tier shrinks back to capacity
    assert "a" not in c and "b" in c
    c.release("zzz")  # no hold: no-op
    with pytest.raises(KeyError, match="not cached"):
        c.hold("a")
    c.hold("b")
    assert c.drop("b") and "b" not in c
