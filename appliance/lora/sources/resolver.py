"""Load on first request (`lora.resolver`): a request that names an unknown adapter is looked up
through URI templates (`s3://bucket/adapters/{name}`, `hf://my-org/{name}`), loaded, then served.

- A name reaches a template only if it is a plain name (RESOLVABLE: letters, digits, `_`, `-`, `.`,
  no `..`): no `/`, URL syntax or control characters can change which object is asked for. The
  URI it makes must still lie under lora.allowed_sources.
- Concurrent first requests for one name share one lookup (one task; each waiter shields it, so a
  client that goes away does not cancel the others' load).
- A lookup that found nothing (or an adapter that cannot be served) is remembered for miss_ttl_s and
  answered from memory. Lookups running plus misses remembered are at most max_misses; past it an
  unknown name is refused with no store call, so the store sees at most max_misses lookups (each up
  to one per template) per miss_ttl_s, whatever names clients send.
Pure Python (no torch): the caller hands in the load, which fetches, reads and commits.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

from appliance.config.schema import ResolverConfig
from appliance.lora.adapter_files import AdapterError
from appliance.lora.names import name_problem, shown
from appliance.lora.sources.uri import SourceError, SourceMissing, check_allowed, parse_allowed, parse_uri

FIELD = "{name}"
RESOLVABLE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_PROBE = "probe-name"  # what a template is checked with at config time


class ResolveError(Exception):
    """A name the resolver will not (or could not) serve; `status` is the HTTP answer."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


@dataclass(frozen=True)
class Miss:
    expires: float
    error: ResolveError


def resolvable_problem(name: str) -> Optional[str]:
    """Why `name` may not be put into a template (None when it may): the registry's name rule, then
    plain-name characters only."""
    problem = name_problem(name)
    if problem is not None:
        return problem
    if not RESOLVABLE.match(name) or ".." in name:
        return "only letters, digits, '_', '-' and '.' (not '..', not first) can be looked up in lora.resolver.sources"
    return None


def fill(template: str, name: str) -> str:
    return template.replace(FIELD, name)


def parse_templates(templates: Sequence[str], allowed_sources: Sequence[str]) -> list[str]:
    """lora.resolver.sources checked: each holds `{name}` (and no other field) and, filled with a
    name, is a URI under lora.allowed_sources. ValueError names the entry."""
    allowed = parse_allowed(allowed_sources)
    for i, t in enumerate(templates):
        key = f"lora.resolver.sources[{i}]"
        if t.count(FIELD) != 1 or t.replace(FIELD, "").count("{") or t.replace(FIELD, "").count("}"):
            raise ValueError(f"{key}: {t!r} must hold {FIELD} exactly once and no other {{...}}")
        try:
            check_allowed(parse_uri(fill(t, _PROBE)), allowed)
        except SourceError as e:
            raise ValueError(f"{key}: {e}") from None
    return list(templates)


class AdapterResolver:
    """The templates, the running lookups and the remembered misses of one server (event-loop side)."""

    def __init__(self, cfg: ResolverConfig, allowed_sources: Sequence[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.templates = parse_templates(cfg.sources, allowed_sources)
        self.ttl_s = cfg.miss_ttl_s
        self.max_misses = cfg.max_misses
        self.clock = clock
        self.misses: OrderedDict[str, Miss] = OrderedDict()  # oldest first
        self.running: dict[str, asyncio.Task] = {}
        self.lookups = 0  # lookups started (each at most one store lookup per template)

    @property
    def enabled(self) -> bool:
        return bool(self.templates)

    async def resolve(self, name: str, load: Callable[[str], Awaitable[None]]) -> str:
        """Make `name` served: `load(uri)` for each template's URI in order until one loads (it raises
        SourceMissing to try the next, any other AdapterError to stop). Returns the URI loaded from;
        ResolveError when the name is refused, unknown, unservable or the lookup budget is spent."""
        problem = resolvable_problem(name)
        if problem is not None:
            raise ResolveError(f"the model {shown(name)} is not loaded and cannot be looked up: {problem}",
                               400, "invalid_model_name")
        task = self.running.get(name)
        if task is None:
            self._expire()
            miss = self.misses.get(name)
            if miss is not None:
                raise miss.error
            if len(self.misses) + len(self.running) >= self.max_misses:
                raise ResolveError(f"the model {shown(name)} is not loaded, and lora.resolver has looked up "
                                   f"{self.max_misses} unknown names in the last {self.ttl_s:g} s "
                                   "(lora.resolver.max_misses); try again later", 429, "resolver_busy")
            self.lookups += 1
            task = asyncio.ensure_future(self._lookup(name, load))
            self.running[name] = task
        return await asyncio.shield(task)

    async def _lookup(self, name: str, load: Callable[[str], Awaitable[None]]) -> str:
        try:
            for template in self.templates:
                uri = fill(template, name)
                try:
                    await load(uri)
                    return uri
                except SourceMissing:
                    continue
                except AdapterError as e:  # found, but it cannot be served (too big, not PEFT, timeout)
                    raise self._remember(name, ResolveError(f"the model {shown(name)} is not loaded; {e}",
                                                            400, "invalid_adapter")) from None
            raise self._remember(name, ResolveError(
                f"the model {shown(name)} does not exist: not loaded, and not found in lora.resolver.sources",
                404, "model_not_found"))
        finally:
            del self.running[name]

    def _remember(self, name: str, err: ResolveError) -> ResolveError:
        self.misses[name] = Miss(self.clock() + self.ttl_s, err)
        self.misses.move_to_end(name)
        return err

    def _expire(self) -> None:
        now = self.clock()
        while self.misses:
            name, miss = next(iter(self.misses.items()))
            if miss.expires > now:
                break
            del self.misses[name]
