"""The async front of the engine: the engine loop runs on its own thread; callers await or stream.

Callers (the HTTP server, benchmarks) use `generate()`, an async iterator of `RequestOutput` updates.
Closing the iterator early (client disconnect, task cancelled) aborts the request and frees its KV
blocks. The engine itself (`LLMEngine`) is single-threaded; this class owns the only thread that steps
it, and hands requests in and aborts over a lock-protected inbox so the step never races a caller.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Union

from appliance.engine.engine import LLMEngine
from appliance.engine.fair_share import Share
from appliance.engine.request import (
    EngineError,
    EngineStoppedError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from appliance.telemetry.stats import EngineEvents, EngineSnapshot

log = logging.getLogger(__name__)

# Receives a request's updates, then at most one error, on the caller's event loop.
OnOutput = Callable[[Union[RequestOutput, BaseException]], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        # Inbox, filled by callers, drained by the engine thread at the start of each step.
        # (request id, prompt ids, params, adapter, arrival time: when the caller submitted it, prompt source)
        self._to_add: list[tuple[str, list[int], SamplingParams, Optional[str], float, Optional[str],
                                 Optional[Share]]] = []
        self._to_abort: list[str] = []
        # Callables to run on the engine thread between steps (admin operations such as adapter loads).
        self._calls: list[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future]] = []
        # request_id -> (event loop, callback) to deliver updates on the caller's loop.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OnOutput]] = {}
        self._accepting = True
        self._stop = False
        self._dead: Optional[BaseException] = None
        # Receives the engine's stats events after every loop iteration, on the engine thread
        # (appliance/telemetry/metrics.py); None = they are dropped, so they never pile up.
        self._stats_sink: Optional[Callable[[EngineEvents], None]] = None
        # Overlap loading: the loop sleeps while every waiter waits on a read; `_reads_done` closes the
        # race of a read ending during the step that saw it in flight.
        self._idle = False
        self._reads_done = 0
        if engine.lora is not None:
            engine.lora.set_load_listener(self._read_finished)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and not self._stop

    def set_stats_sink(self, sink: Optional[Callable[[EngineEvents], None]]) -> None:
        """Where the engine's stats events go (called on the engine thread; must be thread-safe to read
        from elsewhere, as prometheus_client's collectors are). Set it before `start` to miss nothing
        (events since the engine was built, startup adapter loads included, are kept until then)."""
        self._stats_sink = sink

    async def stats(self) -> EngineSnapshot:
        """Hand the events so far to the sink and return the engine's state, read on the engine thread
        between two steps (waits for the step in progress). EngineStoppedError when it is not running."""
        def take() -> EngineSnapshot:
            self._flush_stats()
            return self.engine.snapshot()

        return await self.call(take)

    def stop_accepting(self) -> None:
        """New requests get EngineStoppedError; in-flight ones go on."""
        with self._lock:
            self._accepting = False

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (or timeout); True when drained."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.num_in_flight == 0

    def shutdown(self) -> None:
        """Abort whatever is left and stop the engine thread."""
        with self._lock:
            self._accepting = False
            self._stop = True
            self._wakeup.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self.engine.lora is not None:
            self.engine.lora.set_load_listener(None)  # the engine may be driven again (benchmarks)

    @property
    def stepping(self) -> bool:
        """The engine thread still runs (after `shutdown`: stuck in a step)."""
        return self._thread.is_alive()

    # ----------------------------------------------------------------- requests
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: Optional[str] = None,
                       adapter: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Stream updates for one request until it finishes.

        Raises RequestError (bad params or too long), QueueFullError, EngineStoppedError before the
        first update. Breaking out of the loop, or cancelling the task, aborts the request.
        `adapter` is the LoRA adapter as the client named it (None = base model); the engine
        resolves it when it takes the request (AdapterNotFoundError if it is not loaded then).
        """
        queue: asyncio.Queue = asyncio.Queue()
        rid = self.submit(prompt_token_ids, params, queue.put_nowait, request_id, adapter)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile `params.grammar` (if any) in a worker thread, so the engine thread finds it in the
        compiler's cache and other requests go on meanwhile. Call before `submit`; raises RequestError
        (naming the request field) for a spec that cannot be compiled."""
        if params.grammar is None:
            return
        params.validate()
        spec = params.grammar
        await asyncio.to_thread(lambda: self.engine.grammar_compiler().compile(spec))

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, on_output: OnOutput,
               request_id: Optional[str] = None, adapter: Optional[str] = None,
               prompt_source: Optional[str] = None, share: Optional[Share] = None) -> str:
        """Hand a request to the engine; `on_output` then gets each update, and at most one error
        (after which nothing more), as calls on the caller's event loop. Returns the request id.

        The callback form of `generate` for callers that multiplex many requests (the HTTP server):
        no task or queue per request, so an update costs the loop one call. Raises RequestError,
        QueueFullError, EngineStoppedError at once; the caller aborts with `abort(request_id)`.
        `prompt_source`: LLMEngine.add_request's (parallel samples share the prompt's KV); `share`:
        its tenant for fair admission (engine/fair_share.py).
        """
        params.validate()
        self.engine.check_request(prompt_token_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        with self._lock:
            if not self._accepting or self._dead is not None:
                raise EngineStoppedError("the engine is shutting down" if self._dead is None
                                         else f"the engine stopped: {self._dead}")
            if self.engine.num_waiting + len(self._to_add) >= self.engine.config.max_waiting_requests:
                raise QueueFullError(
                    f"too many waiting requests (engine.max_waiting_requests="
                    f"{self.engine.config.max_waiting_requests})")
            if rid in self._streams:
                raise ValueError(f"duplicate request id {rid}")
            self._streams[rid] = (asyncio.get_running_loop(), on_output)
            self._to_add.append((rid, list(prompt_token_ids), params, adapter, time.monotonic(), prompt_source,
                                 share))
            self._wakeup.notify_all()
        return rid

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between two steps and return its result (or raise its error).

        Admin operations go through here so they never race a step (the engine is single-threaded).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if self._dead is not None or self._stop:
                raise EngineStoppedError("the engine is not running")
            self._calls.append((fn, loop, fut))
            self._wakeup.notify_all()
        return await fut

    def abort(self, request_id: str) -> None:
        """Stop a request (no more updates); its id is free again at once."""
        with self._lock:
            if self._streams.pop(request_id, None) is None:
                return
            for k, pending in enumerate(self._to_add):
                if pending[0] == request_id:  # the engine never saw it
                    del self._to_add[k]
                    return
            self._to_abort.append(request_id)
            self._wakeup.notify_all()

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._stop or self._to_add or self._to_abort or self._calls
                               or (self.engine.has_unfinished() and not self._idle)):
                        self._wakeup.wait()
                    if self._stop:
                        break
                    self._idle = False
                    reads_seen = self._reads_done
                    to_add, self._to_add = self._to_add, []
                    to_abort, self._to_abort = self._to_abort, []
                    calls, self._calls = self._calls, []
                if calls:
                    # Admin operations see a quiet engine: no step of ours still queued on the device
                    # (async scheduling leaves one in flight between iterations).
                    self._deliver(self.engine.settle())
                for fn, loop, fut in calls:
                    try:
                        result: Any = fn()
                    except Exception as e:  # noqa: BLE001 - handed to the caller, who reports it
                        _resolve(loop, fut, error=e)
                    else:
                        _resolve(loop, fut, result=result)
                for rid in to_abort:
                    self.engine.abort(rid)
                for rid, ids, params, adapter, arrival, source, share in to_add:
                    try:
                        self.engine.add_request(rid, ids, params, arrival_time=arrival, adapter=adapter,
                                                prompt_source=source, share=share)
                    except EngineError as e:
                        # E.g. the adapter was unloaded between resolve and add: fail this request only.
                        self._fail(rid, e)
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                    blocked = self.engine.blocked_on_loads()
                    with self._lock:
                        self._idle = blocked and self._reads_done == reads_seen
                self._flush_stats()
        except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
            log.exception("engine loop died")
            self._dead = e
        finally:
            err = EngineStoppedError("the engine stopped" if self._dead is None
                                     else f"the engine stopped: {self._dead}")
            with self._lock:
                streams, self._streams = self._streams, {}
                calls, self._calls = self._calls, []
            for loop, on_output in streams.values():
                _call(loop, on_output, err)
            for _, loop, fut in calls:
                _resolve(loop, fut, error=err)

    def _read_finished(self) -> None:
        """A background adapter read ended (called on its reader thread): wake the loop."""
        with self._lock:
            self._reads_done += 1
            self._idle = False
            self._wakeup.notify_all()

    def _flush_stats(self) -> None:
        events = self.engine.stats.take()
        if self._stats_sink is not None and not events.empty:
            self._stats_sink(events)

    def _fail(self, rid: str, err: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            _call(stream[0], stream[1], err)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's updates to their streams: one wake-up of each caller's event loop per step,
        not one per request (64 streams at ~140 tokens/s each are thousands of loop wake-ups a second,
        on the thread that also parses requests and writes every response)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OnOutput, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted by the caller meanwhile
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody is listening any more


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
             error: Optional[BaseException] = None) -> None:
    def settle() -> None:
        if fut.done():
            return  # the caller gave up (cancelled)
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the caller's loop is closed


def _put_all(items: list[tuple[OnOutput, RequestOutput]]) -> None:
    for on_output, out in items:
        on_output(out)


def _call(loop: asyncio.AbstractEventLoop, on_output: OnOutput, item: RequestOutput | BaseException) -> None:
    try:
        loop.call_soon_threadsafe(on_output, item)
    except RuntimeError:
        pass  # the caller's loop is closed: nobody is listening any more
