"""Admission limits of the inference routes: how many requests run at once, and for how long.

`ConcurrencyLimit` wraps a route's ASGI app and counts the requests inside it, from the first byte
of the body to the last byte of the answer (a stream counts until it ends). Beyond
server.max_concurrent_requests it answers 429 with Retry-After at once, before reading the body, so
a flood costs us neither the body nor an engine request. The engine's own queue bound
(engine.max_waiting_requests, also 429) sits behind it and counts engine requests, not HTTP ones.

`Deadline` is server.request_timeout_s for one request, measured from its arrival: reading the body
past it answers 408, waiting for tokens past it aborts the engine request and answers 504 (an error
event when the stream has started).

The counter needs no lock: every change happens on the server's one event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Optional, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from appliance.server.errors import ApiError

T = TypeVar("T")
# Seconds a client should wait before retrying after a 429: a CPU step takes tens of ms, requests
# seconds, so one second is the order in which capacity frees.
RETRY_AFTER_S = 1


def too_many(message: str, code: str) -> ApiError:
    return ApiError(429, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


class ConcurrencyLimit:
    """At most `limit` requests (0 = no limit) inside every ASGI app that `wrap` returned, together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self.refused = 0  # total 429s given, for tests and logs

    def wrap(self, app: ASGIApp) -> ASGIApp:
        # An instance, not a function: Starlette's Route would take a function for a request handler.
        return _Limited(app, self)

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        if self.limit and self.active >= self.limit:
            self.refused += 1
            err = too_many(f"Too many concurrent requests: the server handles at most {self.limit} at once "
                           f"(server.max_concurrent_requests); retry after {RETRY_AFTER_S} s.",
                           "too_many_requests")
            await err.response()(scope, receive, send)
            return
        self.active += 1
        try:
            await app(scope, receive, send)
        finally:
            self.active -= 1


class _Limited:
    def __init__(self, app: ASGIApp, limit: ConcurrencyLimit) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.limit.run(self.app, scope, receive, send)


class Deadline:
    """server.request_timeout_s for one request (0 = none), counted from construction (its arrival)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at: Optional[float] = time.monotonic() + timeout_s if timeout_s > 0 else None

    def remaining(self) -> Optional[float]:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    async def read(self, work: Awaitable[T]) -> T:
        """`work` (reading the request body) within the deadline, else 408."""
        try:
            return await asyncio.wait_for(work, self.remaining())
        except asyncio.TimeoutError:
            raise ApiError(408, f"The request body did not arrive within server.request_timeout_s "
                                f"({self.timeout_s:g} s).", code="request_timeout") from None

    async def wait(self, work: Awaitable[T]) -> T:
        """`work` (the next engine update) within the deadline, else 504 (the caller aborts)."""
        try:
            return await asyncio.wait_for(work, self.remaining())
        except asyncio.TimeoutError:
            raise ApiError(504, f"The request took longer than server.request_timeout_s ({self.timeout_s:g} s) "
                                "and was aborted.", code="timeout") from None
