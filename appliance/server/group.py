"""The engine requests behind one HTTP request (N prompts = N choices), run concurrently.

Each job is submitted with a callback that puts its updates, in arrival order, on the group's one
queue: no task or queue per job, so a token costs the event loop one call and one wake-up of the
handler. `cancel()` (client gone, handler cancelled, deadline) aborts every unfinished job in the
engine, which frees its KV blocks. With a `Deadline` (server.request_timeout_s), a timer puts a 504
on the queue when it passes, and the caller's `cancel()` aborts the engine requests.

At most `window` jobs (server.prompts_in_flight_per_request) are in the engine at once, the next one
entering as one finishes, in order: a batch of hundreds of prompts is admitted in pieces, so requests
that arrive after it join the engine's FIFO queue between its pieces instead of behind all of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Optional, Union

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.fair_share import Share
from appliance.engine.request import RequestOutput
from appliance.server.limits import Deadline
from appliance.server.protocol import Choice, Job

_Item = tuple[int, Union[RequestOutput, BaseException]]


class RequestGroup:
    def __init__(self, engine: AsyncEngine, jobs: list[Job], request_id: str,
                 deadline: Optional[Deadline] = None, window: int = 0, engine_tag: str = "",
                 share: Optional[Share] = None) -> None:
        self._engine = engine
        self._share = share  # the tenant, for the scheduler's fair admission
        self._window = window if 0 < window < len(jobs) else len(jobs)  # 0 = every job at once
        self._deadline = deadline
        self._jobs = jobs
        self.request_id = request_id
        self._engine_tag = engine_tag  # appended to the engine's request ids (the client's may repeat)
        self.choices = [Choice(prompt_tokens=len(j.prompt_ids), logprobs=None if j.params.logprobs is None else [],
                               counts_prompt=j.prompt_source is None) for j in jobs]
        self._finished = [False] * len(jobs)
        self._running: set[int] = set()  # submitted, not finished, not failed
        self._next_job = 0  # the next job to submit
        self._cancelled = False
        self._timer: Optional[asyncio.TimerHandle] = None
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._buffer: list[tuple[int, RequestOutput]] = []  # updates read by start(), not yet yielded
        self._held: list[_Item] = []  # taken off the queue while merging, to hand out next

    def job_request_id(self, index: int) -> str:
        return self.request_id if len(self._jobs) == 1 else f"{self.request_id}-{index}"

    def _engine_id(self, index: int) -> str:
        return self.job_request_id(index) + self._engine_tag

    async def start(self) -> None:
        """Submit the jobs; return once each of the first window has its first update.

        The engine refuses a request (RequestError, QueueFullError, EngineStoppedError) before its first
        update, so this is where they surface, before any response byte is sent; on one, every job of
        the group is aborted and the error is raised. A job of a later piece refused by the engine
        fails the answer the same way, or ends a started stream with an error event.
        """
        if self._deadline is not None and self._deadline.at is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._deadline.remaining() or 0.0, self._timed_out)
        first = self._window
        started: set[int] = set()
        try:
            while self._next_job < first:
                self._submit_next()
            while len(started) < first:
                i, item = await self._next()
                if isinstance(item, BaseException):
                    raise item
                started.add(i)
                self._buffer.append((i, item))
        except BaseException:
            self.cancel()
            raise

    async def updates(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every update (index, delta) after start(), applied to `choices`; ends when all finished.
        Updates of one job that queued up while the stream was being written are merged into one
        (text and token ids joined): a client that falls behind gets fewer, larger events, not a
        growing backlog, and nothing is dropped."""
        while self._buffer:
            i, out = self._buffer.pop(0)
            self._apply(i, out)
            yield i, out
        while not all(self._finished):
            i, item = await self._next()
            if isinstance(item, BaseException):
                raise item
            for i, out in self._merge_queued(i, item):
                self._apply(i, out)
                yield i, out

    def _merge_queued(self, i: int, first: RequestOutput) -> list[tuple[int, RequestOutput]]:
        """`first` and whatever is queued behind it, consecutive updates of one job merged. An error
        and what follows it are held back for the next _next(), which raises it."""
        merged: list[tuple[int, RequestOutput]] = [(i, first)]
        while not self._held and not self._queue.empty():
            j, item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._held.append((j, item))
                break
            last_i, last = merged[-1]
            if j == last_i and not last.finished:
                merged[-1] = (j, _join(last, item))
            else:
                merged.append((j, item))
        return merged

    async def collect(self) -> list[Choice]:
        async for _ in self.updates():
            pass
        return self.choices

    def cancel(self) -> None:
        """Abort every job still running and submit no more (safe to call twice, and in a `finally`
        under a cancelled scope: it does not await)."""
        self._cancelled = True
        if self._timer is not None:
            self._timer.cancel()
        running, self._running = self._running, set()
        for i in running:
            self._engine.abort(self._engine_id(i))

    async def _next(self) -> _Item:
        if self._held:
            return self._held.pop(0)
        return await self._queue.get()

    def _apply(self, i: int, out: RequestOutput) -> None:
        c = self.choices[i]
        c.text += out.text
        c.token_ids.extend(out.token_ids)
        if c.logprobs is not None and out.logprobs:
            c.logprobs.extend(out.logprobs)
        c.completion_tokens = out.completion_tokens
        if out.finished:
            self._finished[i] = True
            c.finish_reason = out.finish_reason
            c.error = out.error
            c.last = out

    def _submit_next(self) -> None:
        i = self._next_job
        self._next_job += 1
        job = self._jobs[i]
        try:
            source = None if job.prompt_source is None else self._engine_id(job.prompt_source)
            self._engine.submit(job.prompt_ids, job.params, lambda item: self._on_output(i, item),
                                request_id=self._engine_id(i), adapter=job.adapter, prompt_source=source,
                                share=self._share)
        except Exception as e:  # noqa: BLE001 - handed to the handler, which answers it (or 500s)
            self._queue.put_nowait((i, e))
        else:
            self._running.add(i)

    def _on_output(self, i: int, item: Union[RequestOutput, BaseException]) -> None:
        if i not in self._running:
            return  # cancelled meanwhile
        self._queue.put_nowait((i, item))
        if isinstance(item, BaseException) or item.finished:
            self._running.discard(i)
            if not self._cancelled and self._next_job < len(self._jobs):
                self._submit_next()

    def _timed_out(self) -> None:
        self._queue.put_nowait((-1, self._deadline.error()))


def _join(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive updates of one request as one: `b`'s state, both deltas."""
    lps = None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs
    return dataclasses.replace(b, token_ids=a.token_ids + b.token_ids, text=a.text + b.text, logprobs=lps)
