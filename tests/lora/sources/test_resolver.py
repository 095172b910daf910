"""The resolver's rules without a store: which names may reach a template, template checks, one
lookup per name under concurrency, templates in order, and the miss cache's bound on lookups."""

from __future__ import annotations

import asyncio
import random
import string

import pytest

from appliance.config.schema import ResolverConfig
from appliance.lora.adapter_files import AdapterError
from appliance.lora.sources.resolver import AdapterResolver, ResolveError, parse_templates, resolvable_problem
from appliance.lora.sources.uri import SourceMissing

ALLOWED = ["s3://adapters/team", "hf://acme"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def resolver(sources=("s3://adapters/team/{name}",), ttl=60.0, max_misses=8, clock=None) -> AdapterResolver:
    return AdapterResolver(ResolverConfig(list(sources), ttl, max_misses), ALLOWED, clock or Clock())


@pytest.mark.parametrize("name", ["sql", "sql-v2", "team_a.v1", "A1", "x" * 128])
def test_plain_names_resolvable(name: str) -> None:
    assert resolvable_problem(name) is None


@pytest.mark.parametrize("name", ["", "a/b", "..", "x..y", ".hidden", "-x", "s3://evil/x", "a?b", "a#b", "%2e%2e",
                                  "a\\b", "a b", "a\nb", "a\x00b", "u@host", "base:x", "x" * 129, "é"])
def test_malicious_or_odd_names_refused(name: str) -> None:
    assert resolvable_problem(name) is not None


@pytest.mark.parametrize("templates, why", [
    (["s3://adapters/team/x"], "must hold {name} exactly once"),
    (["s3://adapters/team/{name}/{name}"], "must hold {name} exactly once"),
    (["s3://adapters/team/{name}/{other}"], "no other"),
    (["s3://adapters/elsewhere/{name}"], "not under lora.allowed_sources"),
    (["hf://other-org/{name}"], "not under lora.allowed_sources"),
    (["ftp://x/{name}"], "not a remote adapter URI"),
])
def test_bad_templates(templates: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=r"^lora\.resolver\.sources\[0\]: .*" + why.replace("{", r"\{")):
        parse_templates(templates, ALLOWED)


def test_good_templates() -> None:
    assert parse_templates(["s3://adapters/team/{name}", "hf://acme/{name}", "hf://acme/loras@v2/{name}"],
                           ALLOWED) == ["s3://adapters/team/{name}", "hf://acme/{name}", "hf://acme/loras@v2/{name}"]


def test_concurrent_first_requests_share_one_lookup() -> None:
    r = resolver()
    calls: list[str] = []

    async def load(uri: str) -> None:
        calls.append(uri)
        await asyncio.sleep(0.05)

    async def main() -> list[str]:
        return await asyncio.gather(*[r.resolve("sql", load) for _ in range(50)])

    assert asyncio.run(main()) == ["s3://adapters/team/sql"] * 50
    assert calls == ["s3://adapters/team/sql"] and r.running == {} and r.misses == {}


def test_a_waiter_that_goes_away_does_not_cancel_the_load() -> None:
    r = resolver()
    done: list[str] = []

    async def load(uri: str) -> None:
        await asyncio.sleep(0.05)
        done.append(uri)

    async def main() -> str:
        first = asyncio.ensure_future(r.resolve("sql", load))
        second = asyncio.ensure_future(r.resolve("sql", load))
        await asyncio.sleep(0.01)
        first.cancel()
        return await second

    assert asyncio.run(main()) == "s3://adapters/team/sql" and len(done) == 1


def test_templates_tried_in_order_until_one_loads() -> None:
    r = resolver(["s3://adapters/team/a/{name}", "hf://acme/{name}"])
    calls: list[str] = []

    async def load(uri: str) -> None:
        calls.append(uri)
        if uri.startswith("s3://"):
            raise SourceMissing(f"{uri}: does not exist")

    assert asyncio.run(r.resolve("sql", load)) == "hf://acme/sql"
    assert calls == ["s3://adapters/team/a/sql", "hf://acme/sql"]


def test_misses_and_unservable_adapters_are_remembered_for_the_ttl() -> None:
    clock = Clock()
    r = resolver(ttl=30, clock=clock)
    calls: list[str] = []

    async def load(uri: str) -> None:
        calls.append(uri)
        if uri.endswith("/nope"):
            raise SourceMissing(f"{uri}: does not exist")
        raise AdapterError(f"{uri}: peft_type 'IA3' is not supported")

    for _ in range(3):
        with pytest.raises(ResolveError) as e:
            asyncio.run(r.resolve("nope", load))
        assert (e.value.status, e.value.code) == (404, "model_not_found")
        with pytest.raises(ResolveError) as e:
            asyncio.run(r.resolve("ia3", load))
        assert (e.value.status, e.value.code) == (400, "invalid_adapter") and "IA3" in e.value.message
    assert len(calls) == 2
    clock.t += 31
    with pytest.raises(ResolveError):
        asyncio.run(r.resolve("nope", load))
    assert len(calls) == 3


def test_refused_names_never_reach_a_template() -> None:
    r = resolver()

    async def load(uri: str) -> None:
        raise AssertionError(f"looked up {uri}")

    for name in ("../secret", "a/b", "s3://adapters/team/x"):
        with pytest.raises(ResolveError) as e:
            asyncio.run(r.resolve(name, load))
        assert (e.value.status, e.value.code) == (400, "invalid_model_name")
    assert r.lookups == 0


def test_random_unknown_names_are_bounded_by_max_misses_per_ttl() -> None:
    clock = Clock()
    r = resolver(ttl=60, max_misses=8, clock=clock)
    calls: list[str] = []

    async def load(uri: str) -> None:
        calls.append(uri)
        await asyncio.sleep(0)
        raise SourceMissing(f"{uri}: does not exist")

    rng = random.Random(0)
    names = ["".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(1000)]

    async def main() -> list[int]:
        out = await asyncio.gather(*[r.resolve(n, load) for n in names], return_exceptions=True)
        return [e.status for e in out]  # type: ignore[union-attr]

    statuses = asyncio.run(main())
    assert len(calls) == 8 and statuses.count(404) == 8 and statuses.count(429) == 992
    clock.t += 61  # the misses expire: a new window of 8 lookups
    statuses = asyncio.run(main())
    assert len(calls) == 16 and statuses.count(404) == 8
