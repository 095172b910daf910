"""The probes an orchestrator uses, open (no key) like /health:

    GET /health            the process serves HTTP and the engine thread runs (cheap; no engine work)
    GET /ready             readiness: the listener is up with the startup adapters loaded (they load
                           before it opens), the engine runs, and the server is not draining
    GET /health_generate   liveness through the engine: one real one-token generation, bounded by
                           server.health_generate_timeout_s; 200 only if it produced a token

/health stays 200 while every forward step fails (docs/reliability.md); /health_generate does not.
Concurrent /health_generate calls share one generation in flight, so a burst of probes costs one
engine request. It waits in the engine's queue like any request: under a full queue it answers 503.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import EngineError, SamplingParams

if TYPE_CHECKING:
    from appliance.server.state import ServerState

from appliance.server.errors import ApiError

_PROBE_PROMPT = [0]  # one token id: every vocabulary has id 0, and the answer is not looked at


class Probes:
    def __init__(self, engine: AsyncEngine, state: "ServerState", timeout_s: float) -> None:
        self.engine = engine
        self.state = state
        self.timeout_s = timeout_s
        self._probe: Optional[asyncio.Task] = None

    def routes(self) -> list[Route]:
        return [Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/health_generate", self.health_generate, methods=["GET"])]

    def _serving(self) -> None:
        if self.state.draining:
            raise ApiError(503, "The server is shutting down.", code="draining")
        if not self.engine.healthy:
            raise ApiError(503, "The engine is not running.", code="engine_stopped")

    async def health(self, request: Request) -> Response:
        self._serving()
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if not self.state.started:
            raise ApiError(503, "The server is starting.", code="starting")
        self._serving()
        return JSONResponse({"status": "ok"})

    async def health_generate(self, request: Request) -> Response:
        self._serving()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._one_token())
        await asyncio.shield(self._probe)  # a caller that leaves does not cancel the others' probe
        return JSONResponse({"status": "ok"})

    async def _one_token(self) -> None:
        """Raises ApiError 503 unless the engine generates one token within the timeout."""
        start = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            async with asyncio.timeout(self.timeout_s):
                async for out in self.engine.generate(list(_PROBE_PROMPT), params,
                                                      request_id=f"health-{time.monotonic_ns()}"):
                    if out.finished:
                        if out.finish_reason == "length" and out.completion_tokens == 1:
                            return
                        raise ApiError(503, f"The probe's generation ended with {out.finish_reason!r} "
                                            f"({out.error or 'no token'}).", code="generate_failed")
        except TimeoutError:
            raise ApiError(503, f"No token within server.health_generate_timeout_s ({self.timeout_s:g} s).",
                           code="generate_timeout") from None
        except EngineError as e:
            raise ApiError(503, f"The engine refused the probe: {e}", code="generate_failed") from None
        raise ApiError(503, f"The probe's generation ended without a token after "
                            f"{time.monotonic() - start:.1f} s.", code="generate_failed")
