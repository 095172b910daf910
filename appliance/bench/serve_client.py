"""The HTTP side of `appliance bench serve`: one streamed request per call, as clients send them, and the
two load shapes (closed loop at a concurrency, Poisson arrivals).

OpenAI routes go through the official `openai` client (AsyncOpenAI), /generate through the HTTP client
library openai brings (httpx2, or httpx for openai < 3). Every request is greedy with `ignore_eos` (an
extension field the server reads on every route), so each produces exactly its output length.

Timing is the client's: TTFT from sending to the first token-bearing event, ITL between token-bearing
events (an event with k tokens counts k gaps of 1/k of its delay; OpenAI chunks count one token each,
the usage chunk gives the total), e2e to the stream's end.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from appliance.config.schema import ConfigError

INSTALL_HINT = "pip install 'appliance[bench]'"


@dataclass
class RequestSpec:
    prompt_ids: list[int]  # what /generate and /v1/completions send
    text: str  # what /v1/chat/completions sends (the prompt ids decoded); "" without a tokenizer
    output_len: int
    adapter: Optional[str]  # adapter name; None = base model


@dataclass
class Result:
    ok: bool
    failure: str = ""  # the HTTP status ("429"), "connection", "timeout" or "stream_error:<code>"
    error: str = ""  # the first words of the error, for the report
    ttft_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: Optional[float] = None
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None  # as the server counted them, where it says


class Driver(Protocol):
    """Sends one request and times it: the HTTP drivers here, the in-process one in serve_inproc.py."""

    async def __call__(self, spec: RequestSpec) -> Result: ...

    async def aclose(self) -> None: ...


class Timer:
    """Token timing of one request."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last: Optional[float] = None
        self.res = Result(ok=False)

    def tokens(self, k: int) -> None:
        if k <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.res.ttft_s = now - self.t0
        else:
            self.res.itl_s.extend([(now - self.last) / k] * k)
        self.last = now
        self.res.output_tokens += k

    def done(self) -> Result:
        self.res.e2e_s = time.perf_counter() - self.t0
        self.res.ok = self.res.ttft_s is not None
        if not self.res.ok:
            self.res.failure, self.res.error = "no_tokens", "the stream ended without a token"
        return self.res

    def failed(self, failure: str, error: str) -> Result:
        self.res.ok, self.res.failure, self.res.error = False, failure, error[:300]
        return self.res


def import_openai() -> Any:
    try:
        import openai
    except ImportError:
        raise ConfigError(f"bench serve needs the openai client (and httpx): {INSTALL_HINT}") from None
    return openai


def httpx_module() -> Any:
    """The HTTP client library the openai client brings: httpx2 (openai >= 3) or httpx (before). The
    /generate rows need only this, so a host with httpx and no openai can still run them."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        pass
    try:
        import httpx

        return httpx
    except ImportError:
        raise ConfigError(f"bench serve needs httpx (the openai client brings it): {INSTALL_HINT}") from None


def http_client(timeout_s: float) -> Any:
    """An AsyncClient without a connection cap (the load shapes set the concurrency)."""
    httpx = httpx_module()
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=60.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


class OpenAIDriver:
    """Streams /v1/chat/completions (route "chat") or /v1/completions ("completions", token-id prompts)."""

    def __init__(self, url: str, api_key: Optional[str], base_model: str, route: str, http: Any) -> None:
        openai = import_openai()
        self.openai = openai
        self.client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none",
                                         max_retries=0, http_client=http)
        self.base_model = base_model
        self.route = route

    async def aclose(self) -> None:
        await self.client.close()  # and its http client

    async def __call__(self, spec: RequestSpec) -> Result:
        t = Timer()
        common = dict(model=spec.adapter or self.base_model, temperature=0.0, stream=True,
                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        try:
            if self.route == "chat":
                stream = await self.client.chat.completions.create(
                    messages=[{"role": "user", "content": spec.text}], max_completion_tokens=spec.output_len,
                    **common)
            else:
                stream = await self.client.completions.create(prompt=spec.prompt_ids, max_tokens=spec.output_len,
                                                              **common)
            async for chunk in stream:
                if chunk.usage is not None:
                    t.res.prompt_tokens = chunk.usage.prompt_tokens
                    # Tokens that came without text of their own (held back by the detokenizer).
                    t.res.output_tokens = max(t.res.output_tokens, chunk.usage.completion_tokens)
                for c in chunk.choices:
                    text = c.delta.content if self.route == "chat" else c.text
                    if text:
                        t.tokens(1)
        except self.openai.APIStatusError as e:
            return t.failed(str(e.status_code), str(e.message))
        except self.openai.APITimeoutError as e:
            return t.failed("timeout", str(e))
        except self.openai.APIConnectionError as e:
            return t.failed("connection", str(e))
        except self.openai.APIError as e:  # an error event inside the stream
            return t.failed(f"stream_error:{e.code or 'unknown'}", str(e.message))
        return t.done()


class GenerateDriver:
    """Streams the native /generate with token ids (cumulative `output_ids` per event)."""

    def __init__(self, url: str, api_key: Optional[str], http: Any) -> None:
        self.url = url.rstrip("/") + "/generate"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = http

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __call__(self, spec: RequestSpec) -> Result:
        httpx = httpx_module()
        t = Timer()
        body: dict[str, Any] = {"input_ids": spec.prompt_ids, "stream": True, "sampling_params": {
            "max_new_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True}}
        if spec.adapter is not None:
            body["lora_path"] = spec.adapter
        try:
            async with self.http.stream("POST", self.url, json=body, headers=self.headers) as r:
                if r.status_code != 200:
                    return t.failed(str(r.status_code), (await r.aread()).decode("utf-8", "replace"))
                seen = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        err = ev["error"]
                        return t.failed(f"stream_error:{err.get('code') or 'unknown'}", str(err.get("message")))
                    n = len(ev["output_ids"])
                    t.tokens(n - seen)
                    seen = n
                    t.res.prompt_tokens = ev["meta_info"]["prompt_tokens"]
        except httpx.TimeoutException as e:
            return t.failed("timeout", repr(e))
        except httpx.TransportError as e:
            return t.failed("connection", repr(e))
        return t.done()


async def closed_loop(send: Driver, specs: Sequence[RequestSpec], concurrency: int,
                      progress: Optional[Callable[[], None]] = None) -> tuple[list[Result], float]:
    """`concurrency` clients, each sending its next request as soon as its last one ended; results in
    the order of `specs`, and the wall time from the first send to the last end."""
    results: list[Optional[Result]] = [None] * len(specs)
    todo = iter(range(len(specs)))

    async def client() -> None:
        for i in todo:  # a shared iterator: each index goes to exactly one client
            results[i] = await send(specs[i])
            if progress is not None:
                progress()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(concurrency, len(specs)))))
    return [r for r in results if r is not None], time.perf_counter() - t0


async def open_loop(send: Driver, specs: Sequence[RequestSpec], arrivals: Sequence[float],
                    progress: Optional[Callable[[], None]] = None) -> tuple[list[Result], float]:
    """Request i sent at arrivals[i] seconds after the start, whatever is still running."""
    async def one(spec: RequestSpec) -> Result:
        r = await send(spec)
        if progress is not None:
            progress()
        return r

    t0 = time.perf_counter()
    tasks = []
    for spec, at in zip(specs, arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


@dataclass(frozen=True)
class HttpTarget:
    """What a client process needs to build its own driver (an HTTP client belongs to one event loop,
    so drivers do not cross processes)."""

    route: str  # chat | completions | generate
    url: str
    api_key: Optional[str]
    base_model: str
    timeout_s: float

    def driver(self) -> Driver:
        http = http_client(self.timeout_s)
        if self.route == "generate":
            return GenerateDriver(self.url, self.api_key, http)
        return OpenAIDriver(self.url, self.api_key, self.base_model, self.route, http)


@dataclass
class Drive:
    """One load point: the measured results (in the order of the specs), the wall time, and the CPU
    share of the busiest client process (near 1: the client, not the server, may limit the row)."""

    results: list[Result]
    wall_s: float
    client_cpu_util: float


@dataclass
class ClientJob:
    """What one client process sends: its target (and so its key), its warm-up (closed loop, not
    measured), then its measured requests, closed loop at `concurrency` or at `arrivals`."""

    target: HttpTarget
    specs: list[RequestSpec]
    warm: list[RequestSpec] = field(default_factory=list)
    concurrency: int = 0
    arrivals: Optional[list[float]] = None


@dataclass
class JobResult:
    """One client process's measured requests (in the order of its specs), when they began and ended
    (time.time()) and the process's CPU seconds over them."""

    results: list[Result]
    start: float
    end: float
    cpu_s: float

    @property
    def cpu_util(self) -> float:
        return self.cpu_s / max(self.end - self.start, 1e-9)


def drive_processes(target: HttpTarget, specs: Sequence[RequestSpec], warm: Sequence[RequestSpec],
                    concurrency: Optional[int], arrivals: Optional[Sequence[float]], procs: int,
                    measuring: Optional[Callable[[], None]] = None) -> Drive:
    """The load point spread over `procs` client processes (one Python thread streams a few thousand
    events a second, less than a GPU server sends): request i and its arrival go to process i % procs,
    a closed loop's concurrency is split among them. Each warms up, then all start together after
    `measuring()` ran here."""
    shares = [concurrency // procs + (p < concurrency % procs) for p in range(procs)] if concurrency else [0] * procs
    jobs = [ClientJob(target, list(specs[p::procs]), list(warm[p::procs]), shares[p],
                      None if arrivals is None else list(arrivals[p::procs])) for p in range(procs)]
    got = run_client_processes(jobs, target.timeout_s, measuring)
    results: list[Optional[Result]] = [None] * len(specs)
    for p, g in enumerate(got):
        results[p::procs] = g.results
    return Drive([r for r in results if r is not None], max(g.end for g in got) - min(g.start for g in got),
                 max(g.cpu_util for g in got))


def run_client_processes(jobs: Sequence[ClientJob], timeout_s: float,
                         measuring: Optional[Callable[[], None]] = None) -> list[JobResult]:
    """Each job in a client process of its own: all warm up, then `measuring()` runs here, then all
    start their measured requests together. Results in the order of `jobs`."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads and an event loop
    barrier = ctx.Barrier(len(jobs) + 1)
    queue = ctx.Queue()
    workers = [ctx.Process(target=_client_process, daemon=True, args=(p, job, barrier, queue))
               for p, job in enumerate(jobs)]
    for w in workers:
        w.start()
    try:
        barrier.wait(timeout=timeout_s)  # every client warmed up
        if measuring is not None:
            measuring()
        barrier.wait(timeout=60)
        got = dict(queue.get(timeout=timeout_s) for _ in workers)
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    errors = [v for v in got.values() if isinstance(v, str)]
    if errors:
        raise RuntimeError(f"a client process failed: {errors[0]}")
    return [JobResult(*got[p]) for p in range(len(jobs))]


def _client_process(index: int, job: ClientJob, barrier: Any, queue: Any) -> None:
    async def run() -> tuple[list[Result], float, float, float]:
        send = job.target.driver()
        try:
            if job.warm:
                await closed_loop(send, job.warm, max(1, job.concurrency or len(job.warm)))
            barrier.wait()  # nothing in flight on this loop: blocking is fine
            barrier.wait()  # the parent took its "before" snapshot
            cpu0, t0 = time.process_time(), time.time()
            if job.arrivals is None:
                results, _ = await closed_loop(send, job.specs, job.concurrency)
            else:
                results, _ = await open_loop(send, job.specs, job.arrivals)
            return results, t0, time.time(), time.process_time() - cpu0
        finally:
            await send.aclose()

    try:
        queue.put((index, asyncio.run(run())))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        barrier.abort()
        queue.put((index, f"{type(e).__name__}: {e}"))
