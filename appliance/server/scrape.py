"""GET /metrics: the Prometheus scrape of appliance/telemetry/metrics.py, on the server's own port.

Each scrape first asks the engine thread for its state (AsyncEngine.stats: waits for the step in
progress, then hands over the events so far and a snapshot), so the page is exact as of the scrape:
every finished request is counted and the slot gauges equal the pool's state. When the engine is not
running any more the page still answers, with the counters as they are and the gauges as last read.
No key is needed unless metrics.require_key (then one of server.api_keys or a tenant's, as on the inference routes).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import EngineStoppedError
from appliance.telemetry.metrics import CONTENT_TYPE, Metrics
from appliance.server.tenants import TenantAuth


class ScrapeApi:
    def __init__(self, engine: AsyncEngine, metrics: Metrics, auth: TenantAuth, require_key: bool) -> None:
        self.engine = engine
        self.metrics = metrics
        self.auth = auth
        self.require_key = require_key

    def routes(self) -> list[Route]:
        return [Route("/metrics", self.scrape, methods=["GET"])]

    async def scrape(self, request: Request) -> Response:
        if self.require_key:
            self.auth.check(request)
        try:
            snapshot = await self.engine.stats()
        except EngineStoppedError:
            snapshot = None  # stopped or dead: /health says so; the counters are still worth reading
        if snapshot is not None:
            self.metrics.record_snapshot(snapshot)
        return Response(self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})
