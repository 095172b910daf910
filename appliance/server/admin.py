"""LoRA admin routes, and the adapter views they and /v1/models show.

    POST /load_lora_adapter    (also /v1/...)  {lora_name, lora_path, pinned?, load_inplace?, managed?}
    POST /unload_lora_adapter  (also /v1/...)  {lora_name}
    POST /pin_lora_adapter     (also /v1/...)  {lora_name, pinned, managed?}: pin or unpin without a reload
    GET  /v1/adapters                          live state of every adapter, GPU slot pool, CPU tier
    GET  /v1/status                            config generation and hash, last reconcile, conditions

Every admin route needs `Authorization: Bearer <server.admin_key>` (auth.AdminAuth), or a tenant's key
with admin role `admin` (GET /v1/adapters and /v1/status: role `read` is enough). The names and
bodies are SGLang's and vLLM's, so their clients and scripts work unchanged. `managed: true` (ours) is
what `appliance apply` sends: the config owns that adapter, so `reconcile.prune: owned` may unload it
once the config drops it; an adapter loaded without it is unmanaged and left alone.

The operations themselves are `AdapterAdmin`'s, which the in-process reconciler (hot reload) calls
too. Changes hold `AdapterAdmin.lock`, as a whole reconcile does, so an admin call never interleaves
with a reconcile's plan and apply. Every read or change of LoRA state runs on the engine thread through
`AsyncEngine.call`, between two steps: the manager, its registry and its slot pool are single-threaded, and the engine thread mutates
them while it steps. A load reads and checks the adapter's files on a worker thread first
(LoRAManager.prepare), so parsing a large or hostile adapter never pauses stepping; only its commit
runs on the engine thread.

Refusals keep the OpenAI error shape: AdapterError (the adapter's files or path) -> 400,
LoRAStateError -> its own status (404 unknown name, 409 duplicate name or no slot free to pin,
400 pin limit or invalid name). The manager changes nothing when it refuses.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Optional, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.config.schema import ApplianceConfig
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import EngineError, EngineStoppedError
from appliance.lora.adapter import AdapterError
from appliance.lora.manager import LoRAManager, PreparedLoad
from appliance.lora.names import name_problem, shown
from appliance.lora.registry import AdapterEntry, LoRAStateError
from appliance.server.auth import AdminAuth
from appliance.server.errors import ApiError, bad_request
from appliance.server.schemas.admin import LoadLoRAAdapterRequest, PinLoRAAdapterRequest, UnloadLoRAAdapterRequest
from appliance.server.schemas.base import M, validate

if TYPE_CHECKING:
    from appliance.reconcile.controller import Reconciler

T = TypeVar("T")

_STATE_CODES = {400: "invalid_lora_request", 404: "adapter_not_found", 409: "adapter_conflict"}


class AdapterAdmin:
    """The admin operations on the live engine's adapters, for the HTTP routes and the reconciler.

    Callers that change state hold `lock` (the routes take it per call, a reconcile for its whole
    pass). Refusals raise ApiError with the status the HTTP API answers (see the module docstring).
    """

    def __init__(self, engine: AsyncEngine, managed: Iterable[str] = ()) -> None:
        self.engine = engine
        self.lora: Optional[LoRAManager] = engine.engine.lora  # None when lora.enabled is false
        self.lock = asyncio.Lock()
        # Adapter id -> when it was loaded (unix s), for the `created` of its model card.
        self.created: dict[int, int] = {}
        # Names the config owns (the start-up inventory, then what reconciles load or adopt).
        self.managed: set[str] = set(managed)

    async def load(self, name: str, path: str, pinned: bool = False, inplace: bool = False,
                   managed: bool = False, prepared: Optional[PreparedLoad] = None) -> dict[str, Any]:
        """`managed`: the config owns it; else a new name is unmanaged and a reload keeps its owner.
        `prepared`: the files already read (LoRAManager.prepare), else read here on a worker thread."""
        lora = self.enabled()
        problem = name_problem(name)  # before any file is read; the registry applies the same rule
        if problem is not None:
            raise ApiError(400, f"invalid adapter name {shown(name)}: {problem}", param="lora_name",
                           code="invalid_lora_request")
        # The files are read, parsed and checked on a worker thread while the batch runs (an adapter's
        # config may be slow to check: thousands of rank_pattern keys); only the commit (names, pin,
        # registry) takes the engine thread. A refusal comes back from `load`, after its name checks.
        if prepared is None:
            prepared = await asyncio.to_thread(lora.prepare, path)
        view = await run_on_engine(self.engine, lambda: adapter_view(
            lora, lora.load(name, path, pinned=pinned, inplace=inplace, prepared=prepared)))
        self.created.setdefault(view["id"], int(time.time()))  # an in-place reload keeps its card's date
        self.set_managed(name, managed, keep=inplace and not managed)
        return {**view, "managed": name in self.managed}

    async def load_resolved(self, name: str, uri: str) -> None:
        """Load `name` from `uri` on its first request (lora.resolver): unmanaged and unpinned. The
        fetch and read run before the lock, so admin calls and reconciles are not held up by a slow
        store; a fetch or read refusal is raised as the AdapterError it is (SourceMissing: nothing
        there), with nothing changed."""
        lora = self.enabled()
        prepared = await asyncio.to_thread(lora.prepare, uri)
        if prepared.error is not None:
            raise prepared.error
        async with self.lock:
            if name not in lora.registry.published:  # else loaded meanwhile by the admin API or a reconcile
                await self.load(name, uri, prepared=prepared)

    async def unload(self, name: str) -> int:
        """Unload `name`; returns how many requests still run on it (they finish on its weights)."""
        lora = self.enabled()

        def unload() -> tuple[int, int]:
            entry = lora.registry.get(name)  # 404 when unknown, before anything changes
            key = lora.current[name]
            lora.unload(name)
            st = lora.keys.get(key)  # still there while requests run on its weights
            return entry.id, (st.in_flight if st is not None else 0)

        adapter_id, in_flight = await run_on_engine(self.engine, unload)
        self.created.pop(adapter_id, None)
        self.managed.discard(name)
        return in_flight

    async def set_pinned(self, name: str, pinned: bool, managed: Optional[bool] = None) -> dict[str, Any]:
        """Pin or unpin; `managed` (when given) also sets who owns it: the reconciler adopts an
        adapter the admin API loaded once the config declares it."""
        lora = self.enabled()
        view = await run_on_engine(self.engine, lambda: adapter_view(lora, lora.set_pinned(name, pinned)))
        if managed is not None:
            self.set_managed(name, managed)
        return {**view, "managed": name in self.managed}

    def set_managed(self, name: str, managed: bool, keep: bool = False) -> None:
        if keep:
            return
        (self.managed.add if managed else self.managed.discard)(name)

    async def snapshot(self) -> dict[str, Any]:
        if self.lora is None:
            return {"object": "list", "enabled": False, "data": [], "retiring": [], "pool": None, "cache": None}
        lora = self.lora
        body = await run_on_engine(self.engine, lambda: snapshot(lora))
        for d in body["data"]:
            d["managed"] = d["name"] in self.managed
        return body

    def enabled(self) -> LoRAManager:
        if self.lora is None:
            raise ApiError(400, "LoRA serving is off (lora.enabled is false): restart with "
                                "lora.enabled=true to load adapters.", code="lora_disabled")
        return self.lora


class AdminApi:
    def __init__(self, ops: AdapterAdmin, cfg: ApplianceConfig, read_json: Callable[[Request], Awaitable[dict]],
                 reconciler: "Reconciler", auth: Optional[AdminAuth] = None) -> None:
        self.ops = ops
        self.auth = auth if auth is not None else AdminAuth(cfg.server.admin_key)
        self.read_json = read_json  # the app's body reader: size limit, JSON object check
        self.reconciler = reconciler  # /v1/status

    def routes(self) -> list[Route]:
        return [
            Route("/load_lora_adapter", self.load, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
            Route("/unload_lora_adapter", self.unload, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
            Route("/pin_lora_adapter", self.pin, methods=["POST"]),
            Route("/v1/pin_lora_adapter", self.pin, methods=["POST"]),
            Route("/v1/adapters", self.adapters, methods=["GET"]),
            Route("/v1/status", self.status, methods=["GET"]),
        ]

    def created(self, adapter_id: int, default: int) -> int:
        return self.ops.created.get(adapter_id, default)

    # ------------------------------------------------------------------------------ routes
    async def load(self, request: Request) -> Response:
        body = await self._body(request, LoadLoRAAdapterRequest)
        name, path = _non_blank(body.lora_name, "lora_name"), _non_blank(body.lora_path, "lora_path")
        inplace = bool(body.load_inplace)
        async with self.ops.lock:
            view = await self.ops.load(name, path, pinned=bool(body.pinned), inplace=inplace,
                                       managed=bool(body.managed))
        verb = "reloaded in place" if inplace else "loaded"
        return JSONResponse({"success": True, "message": f"LoRA adapter '{name}' {verb} from {view['path']}.",
                             "adapter": view})

    async def unload(self, request: Request) -> Response:
        body = await self._body(request, UnloadLoRAAdapterRequest)
        name = _non_blank(body.lora_name, "lora_name")
        async with self.ops.lock:
            in_flight = await self.ops.unload(name)
        tail = (f" {in_flight} request(s) still running on it finish first; its weights are freed then."
                if in_flight else "")
        return JSONResponse({"success": True, "message": f"LoRA adapter '{name}' unloaded.{tail}",
                             "in_flight": in_flight})

    async def pin(self, request: Request) -> Response:
        body = await self._body(request, PinLoRAAdapterRequest)
        name = _non_blank(body.lora_name, "lora_name")
        async with self.ops.lock:
            view = await self.ops.set_pinned(name, body.pinned, body.managed)
        verb = "pinned to GPU slot %s" % view["slot"] if view["pinned"] else "unpinned"
        return JSONResponse({"success": True, "message": f"LoRA adapter '{name}' {verb}.", "adapter": view})

    async def _body(self, request: Request, model: type[M]) -> M:
        """The admin key checked, then the JSON body read and validated by `model`."""
        self.auth.check(request)
        return validate(model, await self.read_json(request), request.url.path)

    async def adapters(self, request: Request) -> Response:
        self.auth.check(request, need="read")
        return JSONResponse(await self.ops.snapshot())

    async def status(self, request: Request) -> Response:
        self.auth.check(request, need="read")
        return JSONResponse(self.reconciler.status())


# ---------------------------------------------------------------------------------- views
# These read the manager: call them on the engine thread only (inside run_on_engine).

def adapter_view(lora: LoRAManager, entry: AdapterEntry) -> dict[str, Any]:
    """One adapter as GET /v1/adapters shows it.

    tier: "gpu" when its current weights hold a slot, "cpu" when they are in the host cache, else
    "disk" (registered; read again on the next request), "remote" (its disk-cache entry evicted; fetched
    again on the next request). in_flight: requests (waiting or running) on
    its current weights; requests still on the weights before an in-place reload are under `retiring`.
    """
    key = lora.current[entry.name]
    slot = lora.pool.lookup(key)
    tier = lora.tier(entry.name)
    st = lora.keys.get(key)
    return {"name": entry.name, "path": entry.path, "pinned": entry.pinned, "id": entry.id,
            "rank": entry.rank, "target_modules": list(entry.target_modules), "checksum": entry.checksum,
            "base_model_name": entry.base_model_name, "generation": entry.generation, "tier": tier,
            "slot": slot, "in_flight": st.in_flight if st is not None else 0, "revision": entry.revision or None}


def snapshot(lora: LoRAManager) -> dict[str, Any]:
    """The body of GET /v1/adapters: the reconciler's source of truth."""
    entries = lora.registry.entries()
    live = set(lora.current.values())
    # Unloaded or replaced weights that requests still run on; they leave when those finish.
    retiring = [{"key": k, "in_flight": st.in_flight, "slot": lora.pool.lookup(k)}
                for k, st in lora.keys.items() if k not in live]
    pool, cache = lora.pool.stats(), lora.host.stats()
    return {"object": "list", "enabled": True, "data": [adapter_view(lora, e) for e in entries],
            "retiring": retiring,
            "pool": {"slots": pool.slots, "used": pool.used, "pinned": pool.pinned,
                     "pinned_limit": pool.slots - 1, "evictions": pool.evictions},
            "cache": {"entries": cache.entries, "capacity": cache.capacity, "loads": cache.loads,
                      "evictions": cache.evictions}}


def adapter_card(entry: AdapterEntry, base_name: str, created: int) -> dict[str, Any]:
    """The /v1/models card of an adapter (vLLM's lineage: parent = base model, root = adapter path)."""
    return {"id": entry.name, "object": "model", "created": created, "owned_by": "appliance",
            "root": entry.path, "parent": base_name}


async def run_on_engine(engine: AsyncEngine, fn: Callable[[], T]) -> T:
    """`fn()` on the engine thread; LoRA refusals and a stopped engine become ApiErrors."""
    try:
        return await engine.call(fn)
    except AdapterError as e:
        raise ApiError(400, str(e), param="lora_path", code="invalid_adapter") from None
    except LoRAStateError as e:
        raise ApiError(e.status, e.message, param="lora_name" if e.status in (404, 409) else None,
                       code=_STATE_CODES.get(e.status)) from None
    except EngineStoppedError as e:
        raise ApiError(503, str(e), code="engine_stopped") from None
    except EngineError as e:
        raise ApiError(500, f"{type(e).__name__}: {e}", code="engine_error") from None


# ---------------------------------------------------------------------------------- body fields

def _non_blank(v: str, key: str) -> str:
    if not v.strip():
        raise bad_request(f"'{key}' must be a non-empty string.", key)
    return v
