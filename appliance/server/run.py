"""Run the server: build the engine, serve HTTP with uvicorn, drain on SIGTERM/SIGINT.

Shutdown sequence on the first SIGTERM or SIGINT:
  1. /health and new inference requests answer 503 (the listener stays open so clients get an answer);
  2. in-flight requests run to completion for at most server.shutdown_timeout_s (AsyncEngine.drain);
     whatever is left then is aborted (streams end with an error event, others get 503);
  3. uvicorn closes the listener and connections, the engine stops (with tensor parallelism, then
     every other rank), `serve` returns (exit status 0).
A second signal during the drain exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Iterator, Optional

import uvicorn

from appliance.config.schema import ApplianceConfig
from appliance.engine.async_engine import AsyncEngine
from appliance.reconcile.controller import ConfigSource
from appliance.server.app import build_app, build_metrics
from appliance.server.logs import setup_logging
from appliance.telemetry.metrics import Metrics
from appliance.server.state import ServerState

if TYPE_CHECKING:
    from appliance.telemetry.tracing import RequestTracer

log = logging.getLogger(__name__)

# After the drain, how long uvicorn waits for connections to finish before cancelling them.
_CONNECTION_CLOSE_TIMEOUT_S = 5


def serve(cfg: ApplianceConfig, source: Optional[ConfigSource] = None) -> None:
    """Load the model, start the engine and serve until a signal; returns after a clean shutdown.
    With `source` (where cfg was composed from) and reconcile.watch, the config dir is hot-reloaded."""
    setup_logging(cfg.server.log_level, cfg.logging.format)
    tracer = build_request_tracer(cfg)  # before the model load: a missing extra fails at once
    log.info("loading model %s from %s", cfg.model.name, cfg.model.path)
    engine, metrics = start_engine(cfg)
    try:
        make_server(engine, cfg, source, metrics, tracer).run()
    finally:
        engine.shutdown()
        # Then the other tensor-parallel ranks (none at tp_size 1); killed if a step is stuck.
        engine.engine.close(graceful=not engine.stepping)
    log.info("server stopped")


def start_engine(cfg: ApplianceConfig) -> tuple[AsyncEngine, Optional[Metrics]]:
    """The engine for cfg, started, with its metrics (None when disabled) as its stats sink."""
    from appliance.engine.engine import LLMEngine

    llm = LLMEngine.from_config(cfg)
    metrics = build_metrics(llm, cfg)
    engine = AsyncEngine(llm, stats_sink=metrics.record_events if metrics is not None else None)
    engine.start()
    return engine, metrics


def build_request_tracer(cfg: ApplianceConfig) -> Optional["RequestTracer"]:
    """The request spans' tracer (telemetry/tracing.py) when tracing.enabled, else None (nothing of
    OpenTelemetry imported). ConfigError when the tracing extra is not installed."""
    if not cfg.tracing.enabled:
        return None
    from appliance.telemetry.tracing import build_tracer

    return build_tracer(cfg.tracing)


def make_server(engine: AsyncEngine, cfg: ApplianceConfig, source: Optional[ConfigSource] = None,
                metrics: Optional[Metrics] = None, tracer: Optional["RequestTracer"] = None) -> "DrainingServer":
    """A uvicorn server for a started `engine` on cfg.server.host/port (port 0 = any free port); `metrics`
    as start_engine returns them; `tracer` as build_request_tracer does (tests: one with an in-memory
    exporter), shut down (its spans exported) with the server."""
    app = build_app(engine, cfg, source, metrics, tracer)
    # The request line (server/request_log.py) replaces uvicorn's access log; under JSON uvicorn's
    # loggers keep no handlers of their own and reach the root one (server/logs.py).
    log_config = None if cfg.logging.format == "json" else uvicorn.config.LOGGING_CONFIG
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port,
                            log_level=cfg.server.log_level, lifespan="off", access_log=False,
                            log_config=log_config, timeout_graceful_shutdown=_CONNECTION_CLOSE_TIMEOUT_S)
    server = DrainingServer(config, engine, app.state.server, cfg.server.shutdown_timeout_s)
    server.tracer = tracer
    return server


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signal starts a drain instead of closing at once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, state: ServerState,
                 shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.state = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self._drain_requested = False
        self._drain_task: Optional[asyncio.Task] = None
        self._reload_stop: Optional[asyncio.Event] = None
        self._reload_tasks: list[asyncio.Task] = []
        self.tracer: Optional[RequestTracer] = None  # exports what it holds at shutdown

    @property
    def port(self) -> int:
        """The bound port (useful with server.port=0); valid once `started`."""
        return self.servers[0].sockets[0].getsockname()[1]

    def request_drain(self) -> None:
        """Start the shutdown sequence; safe from a signal handler or another thread (sets a flag
        that the server's loop picks up within 0.1 s)."""
        self._drain_requested = True

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        if self._drain_requested:
            log.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
        else:
            log.info("%s: draining (at most %.0f s)", signal.Signals(sig).name, self.shutdown_timeout_s)
            self.request_drain()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Like uvicorn's, but without re-raising the signal after the shutdown: uvicorn does that so
        # the default handler kills the process, which would make a clean drain exit with 143, not 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: Optional[list] = None) -> None:
        await super().startup(sockets)
        self._start_hot_reload()
        self.state.started = True  # GET /ready: the startup adapters were loaded with the engine

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        await self._stop_hot_reload()
        await super().shutdown(sockets)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # blocks up to tracing.export_timeout_s

    def _start_hot_reload(self) -> None:
        from appliance.reconcile.watch import run_resync, run_watch

        rec = self.state.reconciler
        if rec.source is None:
            return  # built from a config object (tests, embedding): nothing to watch
        rcfg = rec.running.reconcile
        self._reload_stop = asyncio.Event()
        if rcfg.watch and not _has_watchfiles():
            log.error("reconcile.watch is on but the watchfiles package is missing: not watching %s "
                      "(periodic resync still runs when reconcile.resync_s > 0)", rec.source.config_dir)
        elif rcfg.watch:
            self._reload_tasks.append(asyncio.create_task(
                run_watch(rec, rec.source.config_dir, rcfg.debounce_s, self._reload_stop)))
        if rcfg.resync_s > 0:
            self._reload_tasks.append(asyncio.create_task(run_resync(rec, rcfg.resync_s, self._reload_stop)))

    async def _stop_hot_reload(self) -> None:
        if self._reload_stop is not None:
            self._reload_stop.set()
        for t in self._reload_tasks:
            try:
                await asyncio.wait_for(t, timeout=5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass  # wait_for cancelled it: a reconcile in progress is abandoned at shutdown
        self._reload_tasks.clear()

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        self.state.draining = True
        await self._stop_hot_reload()  # no adapter changes while requests drain
        self.engine.stop_accepting()
        log.info("draining %d in-flight request(s)", self.engine.num_in_flight)
        if not await self.engine.drain(self.shutdown_timeout_s):
            log.warning("server.shutdown_timeout_s (%s s) passed with %d request(s) in flight; aborting",
                        self.shutdown_timeout_s, self.engine.num_in_flight)
            # Stopping the engine ends the remaining requests with EngineStoppedError; the join
            # blocks, so keep it off the event loop that must still send those answers.
            await asyncio.to_thread(self.engine.shutdown)
        self.should_exit = True


def _has_watchfiles() -> bool:
    import importlib.util

    return importlib.util.find_spec("watchfiles") is not None
