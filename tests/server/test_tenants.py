"""server/tenants.py without a server: key lookup, scopes, token buckets, tickets, reloads (a fake clock)."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from appliance.config.schema import ConfigError, TenantConfig, TenantLimits
from appliance.server import tenants as tenants_mod
from appliance.server.errors import ApiError
from appliance.server.tenants import TenantTable, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Seen:
    """A TenantObserver that records what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def known(self, names: tuple[str, ...]) -> None: ...

    def rejected(self, tenant: str, reason: str) -> None:
        self.events.append(("rejected", tenant, reason))

    def admitted(self, tenant: str) -> None:
        self.events.append(("admitted", tenant))

    def first_output(self, tenant: str, wait_s: float) -> None:
        self.events.append(("first_output", tenant, wait_s))

    def finished(self, tenant: str, prompt: int, completion: int) -> None:
        self.events.append(("finished", tenant, prompt, completion))


def table(clock: Clock, **cfgs: TenantConfig) -> TenantTable:
    return TenantTable(cfgs, clock=clock, observer=Seen())


def test_identify_by_key_and_hash() -> None:
    clock = Clock()
    t = table(clock, a=TenantConfig(keys=["key-a-1", "key-a-2"]),
              b=TenantConfig(key_sha256=[hashlib.sha256(b"key-b").hexdigest().upper()]))
    assert t.identify(b"key-a-1").name == "a" and t.identify(b"key-a-2").name == "a"
    assert t.identify(b"key-b").name == "b"
    assert t.identify(b"key-a") is None and t.identify(b"") is None


def test_keys_held_only_as_digests_and_compared_without_early_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    t = table(Clock(), a=TenantConfig(keys=["the-secret-key", "k2"]), b=TenantConfig(keys=["k3"]))
    assert "the-secret-key" not in repr(t.tenants["a"]) and "the-secret-key" not in repr(t._digests)
    calls: list[int] = []
    real = hmac.compare_digest

    def counted(x: bytes, y: bytes) -> bool:
        calls.append(len(x))
        return real(x, y)

    monkeypatch.setattr(tenants_mod.hmac, "compare_digest", counted)
    for token in (b"the-secret-key", b"k3", b"nobody", b"x" * 1000):
        calls.clear()
        t.identify(token)
        assert calls == [32, 32, 32]  # every digest, whichever matched, all of one length


def test_scope_names_and_globs() -> None:
    t = table(Clock(), a=TenantConfig(keys=["k"], adapters=["team-a-*", "shared"], allow_base=False))
    a = t.tenants["a"]
    assert a.may_use("team-a-x") and a.may_use("shared")
    assert not a.may_use("team-b-x") and not a.may_use("shared2") and not a.may_use(None)
    assert a.visible(["team-a-1", "team-b-1", "shared"]) == ("team-a-1", "shared")


def test_token_bucket() -> None:
    b = TokenBucket(rate=2.0, capacity=4.0, level=4.0, stamp=0.0)
    assert [b.take(1, 0.0) for _ in range(4)] == [None] * 4
    assert b.take(1, 0.0) == pytest.approx(0.5)  # 1 token at 2/s
    assert b.take(1, 0.5) is None
    b.give(100, 0.5)
    assert b.level == 4.0  # never beyond capacity


def test_requests_per_s_and_concurrency_give_429_with_retry_after() -> None:
    clock = Clock()
    t = table(clock, a=TenantConfig(keys=["k"], limits=TenantLimits(requests_per_s=1, burst=2, max_concurrent=3)))
    a = t.tenants["a"]
    tickets = [t.admit(a), t.admit(a)]
    with pytest.raises(ApiError) as e:
        t.admit(a)
    assert e.value.status == 429 and e.value.code == "requests_per_s" and e.value.headers["Retry-After"] == "1"
    clock.t += 1.0
    tickets.append(t.admit(a))
    clock.t += 10.0
    with pytest.raises(ApiError) as e:
        t.admit(a)  # three in flight
    assert e.value.status == 429 and e.value.code == "tenant_concurrency" and "Retry-After" in e.value.headers
    tickets[0].release()
    tickets[0].release()  # idempotent
    assert a.active == 2
    t.admit(a)
    assert [ev[2] for ev in t.observer.events if ev[0] == "rejected"] == ["requests_per_s", "concurrency"]


def test_tokens_per_min_reserves_and_refunds() -> None:
    clock = Clock()
    t = table(clock, a=TenantConfig(keys=["k"], limits=TenantLimits(tokens_per_min=600, max_tokens_per_request=100)))
    a = t.tenants["a"]
    first = t.admit(a)
    first.reserve([(200, 100), (200, 100)])  # 600: the whole minute
    second = t.admit(a)
    with pytest.raises(ApiError) as e:
        second.reserve([(10, 10)])
    assert e.value.status == 429 and e.value.code == "tokens_per_min"
    assert int(e.value.headers["Retry-After"]) == 2  # 20 tokens at 10/s
    first.used = lambda: (400, 50)  # stopped early: 150 of the reserved tokens come back
    first.release()
    second.reserve([(50, 100)])
    with pytest.raises(ApiError) as e:
        t.admit(a).reserve([(1, 101)])
    assert e.value.status == 400 and e.value.param == "max_tokens"
    with pytest.raises(ApiError) as e:
        t.admit(a).reserve([(600, 1)])  # more than a minute's worth: never admissible, so not a 429
    assert e.value.status == 400


def test_reload_keeps_state_rotates_keys_and_drops_tenants() -> None:
    clock = Clock()
    t = table(clock, a=TenantConfig(keys=["old"], limits=TenantLimits(requests_per_s=1, burst=1)),
              b=TenantConfig(keys=["kb"]))
    a = t.tenants["a"]
    held = t.admit(a)
    t.update({"a": TenantConfig(keys=["old", "new"], limits=TenantLimits(requests_per_s=1, burst=1))})
    assert t.identify(b"new") is a and t.identify(b"old") is a and t.identify(b"kb") is None
    assert a.active == 1  # the request in flight still counts
    with pytest.raises(ApiError):
        t.admit(a)  # the emptied bucket was kept
    t.update({"a": TenantConfig(keys=["new"], limits=TenantLimits(requests_per_s=1, burst=1))})
    assert t.identify(b"old") is None
    held.release()
    assert a.active == 0


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="tenants.x: needs keys"):
        TenantConfig().check("x")
    with pytest.raises(ConfigError, match=r"tenants.x.key_sha256\[0\]"):
        TenantConfig(key_sha256=["abc"]).check("x")
    with pytest.raises(ConfigError, match="tenants.x.admin"):
        TenantConfig(keys=["k"], admin="root").check("x")
    with pytest.raises(ConfigError, match="tenants.x.limits.tokens_per_min"):
        TenantConfig(keys=["k"], limits=TenantLimits(tokens_per_min=-1)).check("x")
    with pytest.raises(ConfigError, match="tenants.x.weight"):
        TenantConfig(keys=["k"], weight=0).check("x")
