"""Load on first request (`lora.resolver`): the server side of lora/sources/resolver.py.

Before a request's adapter names are resolved, each one the registry does not know is looked up
through the resolver's templates and loaded as an unmanaged, unpinned adapter (evictable like any
other, listed in /v1/adapters). The fetch and the read run on a worker thread and only the commit
takes the engine thread, so other requests go on meanwhile; only requests for that name wait.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Optional, Sequence

from appliance.lora.sources.resolver import AdapterResolver, ResolveError
from appliance.server.admin import AdapterAdmin
from appliance.server.errors import ApiError
from appliance.server.tenants import Tenant

if TYPE_CHECKING:
    from appliance.telemetry.tracing import RequestTracer


class FirstUse:
    def __init__(self, ops: AdapterAdmin, resolver: AdapterResolver, base_name: str,
                 tracer: Optional["RequestTracer"] = None) -> None:
        self.ops = ops
        self.resolver = resolver
        self.base_name = base_name
        self.tracer = tracer  # tracing.enabled: the wait for each load is an adapter_load span

    def unknown(self, names: Sequence[Optional[str]], published: Sequence[str]) -> list[str]:
        """The adapter names among `names` (a `model` or `<base>:<adapter>`) that are not loaded."""
        out: list[str] = []
        for n in dict.fromkeys(names):
            if n is None or n == self.base_name or n in published:
                continue
            base, sep, adapter = n.rpartition(":")
            if sep:
                if base != self.base_name or adapter in published:
                    continue  # another base: resolve_model answers its 404
                n = adapter
            out.append(n)
        return out

    async def ensure(self, names: Sequence[Optional[str]], param: str, tenant: Optional[Tenant] = None) -> None:
        """Load each unknown adapter in `names`; ApiError (4xx) when one is refused or not found.
        `tenant`: names outside its adapters are not fetched (resolve_model answers them as unknown)."""
        lora = self.ops.lora
        if lora is None or not self.resolver.enabled:
            return
        for name in self.unknown(names, lora.registry.published):
            if tenant is not None and not tenant.may_use(name):
                continue
            traced = nullcontext() if self.tracer is None else self.tracer.span(
                "adapter_load", {"appliance.adapter": name, "appliance.adapter_source": "resolver"})
            try:
                with traced:
                    await self.resolver.resolve(name, partial(self.ops.load_resolved, name))
            except ResolveError as e:
                raise ApiError(e.status, e.message, param=param, code=e.code) from None
