"""Tenants at the HTTP layer: whose key a request carries, what it may use, and how much it may take.

The table is built from `tenants:` (config/schema.py TenantConfig) and rebuilt on every valid hot
reload (`TenantTable.update`): keys rotate without a restart, and a tenant that stays keeps its
buckets and its count of requests in flight. Keys are held only as sha256 digests; a presented key is
hashed once and compared with hmac.compare_digest against every digest of every tenant, without an
early exit (auth.keys_match's rule), so timing tells nothing about which key was close.

Limits (0 = none), checked in this order:
- before the body is read (`admit`): max_concurrent, then the requests/s bucket -> 429 + Retry-After;
- once the body is parsed (`Ticket.reserve`): max_tokens_per_request (400, naming max_tokens), then
  the tokens/min bucket, which reserves prompt + max_tokens for every job -> 429 + Retry-After; what
  the request did not generate is given back when it ends, so the rate is never exceeded.

Every change happens on the server's one event loop: no lock.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

from starlette.requests import Request

from appliance.config.schema import TenantConfig, TenantLimits
from appliance.engine.fair_share import Share
from appliance.server.auth import ApiKeyAuth, bearer_token
from appliance.server.errors import ApiError
from appliance.telemetry.tenant_metrics import NO_TENANT, TenantObserver


@dataclass
class TokenBucket:
    """Refills at `rate` per second up to `capacity`; `take` succeeds only when the whole amount is there."""

    rate: float
    capacity: float
    level: float
    stamp: float

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, n: float, now: float) -> Optional[float]:
        """Take `n` and return None, or take nothing and return the seconds until `n` is there."""
        self._refill(now)
        if n <= self.level:
            self.level -= n
            return None
        return (n - self.level) / self.rate

    def give(self, n: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + n)

    def resized(self, rate: float, capacity: float, now: float) -> "TokenBucket":
        """The same bucket under new limits: what it holds is kept, up to the new capacity."""
        self._refill(now)
        return TokenBucket(rate, capacity, min(self.level, capacity), now)


def _bucket(rate: float, capacity: float, old: Optional[TokenBucket], now: float) -> Optional[TokenBucket]:
    if rate <= 0:
        return None
    if old is None:
        return TokenBucket(rate, capacity, capacity, now)  # a new tenant starts with a full bucket
    return old.resized(rate, capacity, now)


@dataclass
class Tenant:
    name: str
    cfg: TenantConfig
    requests: Optional[TokenBucket] = None
    tokens: Optional[TokenBucket] = None
    active: int = 0  # requests admitted and not yet ended

    @property
    def limits(self) -> TenantLimits:
        return self.cfg.limits

    def configure(self, cfg: TenantConfig, now: float) -> None:
        self.cfg = cfg
        lim = cfg.limits
        self.requests = _bucket(lim.requests_per_s, lim.burst or max(1.0, lim.requests_per_s), self.requests, now)
        self.tokens = _bucket(lim.tokens_per_min / 60.0, float(lim.tokens_per_min), self.tokens, now)

    @property
    def share(self) -> Share:
        """Its flow in the scheduler's fair admission (engine/fair_share.py)."""
        return Share(self.name, self.cfg.weight)

    @property
    def scoped(self) -> bool:
        """False for TenantTable.unscoped (server.api_keys, an open server)."""
        return self.name != NO_TENANT

    def may_use(self, adapter: Optional[str]) -> bool:
        """Whether this tenant may use `adapter` (None = the base model)."""
        if adapter is None:
            return self.cfg.allow_base
        return any(fnmatch.fnmatchcase(adapter, pattern) for pattern in self.cfg.adapters)

    def visible(self, names: Iterable[str]) -> tuple[str, ...]:
        return tuple(n for n in names if self.may_use(n))


@dataclass
class Ticket:
    """One admitted request of a tenant: its slot in max_concurrent and its tokens/min reservation."""

    tenant: Tenant
    clock: Callable[[], float]
    observer: TenantObserver
    arrived: float = 0.0
    reserved: int = 0
    # (prompt, completion) tokens the request used so far, read when it ends (set once it started).
    used: Optional[Callable[[], tuple[int, int]]] = None
    released: bool = False

    def on_reject(self, tenant: str, reason: str) -> None:
        self.observer.rejected(tenant, reason)

    def started(self) -> None:
        """Every job of the request has its first update from the engine."""
        self.observer.first_output(self.tenant.name, self.clock() - self.arrived)

    def reserve(self, jobs: Iterable[tuple[int, int]]) -> None:
        """Check max_tokens_per_request and reserve tokens/min for `jobs` = (prompt tokens, max_tokens)."""
        jobs = list(jobs)
        lim, name = self.tenant.limits, self.tenant.name
        if lim.max_tokens_per_request:
            worst = max((m for _, m in jobs), default=0)
            if worst > lim.max_tokens_per_request:
                self.on_reject(name, "max_tokens")
                raise ApiError(400, f"'max_tokens' is {worst}; this key may ask for at most "
                                    f"{lim.max_tokens_per_request} tokens per request.", param="max_tokens",
                               code="max_tokens_exceeded")
        bucket = self.tenant.tokens
        if bucket is None:
            return
        need = sum(p + m for p, m in jobs)
        if need > bucket.capacity:
            self.on_reject(name, "tokens_per_min")
            raise ApiError(400, f"This request needs up to {need} tokens (prompt + max_tokens); this key may "
                                f"use at most {lim.tokens_per_min} per minute. Lower max_tokens.",
                           param="max_tokens", code="tokens_per_min_exceeded")
        wait = bucket.take(need, self.clock())
        if wait is not None:
            self.on_reject(name, "tokens_per_min")
            raise too_many_for(f"Token rate limit reached: this key may use {lim.tokens_per_min} tokens per "
                               "minute (prompt + max_tokens reserved per request).", "tokens_per_min", wait)
        self.reserved = need

    def release(self) -> None:
        """The request ended: free its concurrency slot, give back the tokens it reserved and did not use."""
        if self.released:
            return
        self.released = True
        self.tenant.active -= 1
        prompt, completion = self.used() if self.used is not None else (0, 0)
        self.observer.finished(self.tenant.name, prompt, completion)
        bucket = self.tenant.tokens
        if bucket is not None and self.reserved and self.used is not None:
            bucket.give(self.reserved - min(self.reserved, prompt + completion), self.clock())


def too_many_for(message: str, code: str, wait_s: float) -> ApiError:
    """429 with Retry-After: whole seconds until the limit lets the request in (at least 1)."""
    return ApiError(429, message, code=code, headers={"Retry-After": str(max(1, math.ceil(wait_s)))})


class TenantTable:
    """The tenants of the running config: key digests -> tenant, and each tenant's limits state."""

    def __init__(self, tenants: Mapping[str, TenantConfig], clock: Callable[[], float] = time.monotonic,
                 observer: Optional[TenantObserver] = None) -> None:
        self.clock = clock
        self.observer = observer or TenantObserver()  # metrics
        self.tenants: dict[str, Tenant] = {}
        self._digests: list[tuple[bytes, Tenant]] = []
        # Requests with server.api_keys or on an open server: no scope, no limits, counted in metrics.
        self.unscoped = Tenant(NO_TENANT, TenantConfig(adapters=["*"]))
        self.unscoped.configure(self.unscoped.cfg, clock())
        self.update(tenants)

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.tenants)

    def update(self, tenants: Mapping[str, TenantConfig]) -> None:
        """Take a new `tenants:` (already checked). Tenants that stay keep their buckets and in-flight
        count; requests in flight keep running whatever their key became."""
        now = self.clock()
        table: dict[str, Tenant] = {}
        for name, cfg in tenants.items():
            t = self.tenants.get(name) or Tenant(name, cfg)
            t.configure(cfg, now)
            table[name] = t
        self.tenants = table
        self.observer.known(tuple(table))
        self._digests = [(bytes.fromhex(d), t) for t in table.values() for d in t.cfg.key_digests()]

    def identify(self, token: bytes) -> Optional[Tenant]:
        """The tenant whose key `token` is; None when none. Constant time in the token's content."""
        digest = hashlib.sha256(token).digest()
        found: Optional[Tenant] = None
        for d, tenant in self._digests:
            if hmac.compare_digest(digest, d):  # no break: every digest is compared
                found = tenant
        return found

    def admit(self, tenant: Tenant) -> Ticket:
        """A ticket for a new request of `tenant`, or a 429 (max_concurrent, then requests/s)."""
        lim = tenant.limits
        if lim.max_concurrent and tenant.active >= lim.max_concurrent:
            self.observer.rejected(tenant.name, "concurrency")
            raise too_many_for(f"Too many concurrent requests for this key: at most {lim.max_concurrent} "
                               "at once.", "tenant_concurrency", 1.0)
        if tenant.requests is not None:
            wait = tenant.requests.take(1, self.clock())
            if wait is not None:
                self.observer.rejected(tenant.name, "requests_per_s")
                raise too_many_for(f"Request rate limit reached: this key may send {lim.requests_per_s:g} "
                                   "requests per second.", "requests_per_s", wait)
        tenant.active += 1
        self.observer.admitted(tenant.name)
        return Ticket(tenant, self.clock, self.observer, arrived=self.clock())


@dataclass
class TenantAuth:
    """The inference routes' keys: a tenant's key, or one of server.api_keys (any adapter, no tenant
    limits). With no tenants it is ApiKeyAuth alone (empty server.api_keys = open)."""

    table: TenantTable
    legacy: ApiKeyAuth
    _missing: ApiError = field(default_factory=lambda: ApiError(
        401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"}))

    @property
    def enabled(self) -> bool:
        return self.table.enabled or self.legacy.enabled

    def check(self, request: Request) -> Optional[Tenant]:
        """The request's tenant (None: server.api_keys or an open server), or ApiError 401."""
        if not self.table.enabled:
            self.legacy.check(request)
            return None
        token = bearer_token(request)
        if token is None:
            raise self._missing
        tenant = self.table.identify(token)
        if tenant is not None:
            return tenant
        if self.legacy.enabled:
            self.legacy.check(request)  # 401 unless it is one of server.api_keys
            return None
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
