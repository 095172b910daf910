"""Admission limits of the inference routes: how many requests run at once, and for how long.

`ConcurrencyLimit` wraps a route's ASGI app and counts the requests inside it, from the moment their
body has been read to the last byte of the answer (a stream counts until it ends). The body is read
first, within server.body_timeout_s (408 beyond) and server.max_request_body_bytes (413), and only
then is a slot taken: clients that open requests and trickle or never finish their bodies hold no
slot, and each is dropped after the body timeout. Beyond server.max_concurrent_requests it answers
429 with Retry-After, at once when the limit is already full on arrival (before reading the body, so
a flood costs us neither the body nor an engine request), else once the body is in. The engine's own
queue bound (engine.max_waiting_requests, also 429) sits behind it and counts engine requests, not
HTTP ones.

`Deadline` is server.request_timeout_s for one request, counted from when its handler starts (its
body read): waiting for tokens past it aborts the engine request and answers 504 (an error event
when the stream has started).

The counter needs no lock: every change happens on the server's one event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.server.errors import ApiError

# Seconds a client should wait before retrying after a 429: a CPU step takes tens of ms, requests
# seconds, so one second is the order in which capacity frees.
RETRY_AFTER_S = 1


def too_many(message: str, code: str) -> ApiError:
    return ApiError(429, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


class BodyLimits:
    """How much and how long a request body may take: server.max_request_body_bytes and
    server.body_timeout_s, with server.request_timeout_s as an upper bound on the time (0 = none)."""

    def __init__(self, max_bytes: int, timeout_s: float, request_timeout_s: float = 0.0) -> None:
        self.max_bytes = max_bytes
        limits = [(t, k) for t, k in ((timeout_s, "server.body_timeout_s"),
                                       (request_timeout_s, "server.request_timeout_s")) if t > 0]
        self.timeout_s, self.timeout_key = min(limits) if limits else (0.0, "")

    async def read(self, receive: Receive, content_length: Optional[str]) -> bytes:
        """The whole body from ASGI `receive`: 413 when Content-Length or the bytes received pass
        max_bytes, 400 for a malformed Content-Length, 408 past the timeout; ClientDisconnect when the
        client goes away."""
        if content_length is not None:
            if not content_length.isdigit():
                raise ApiError(400, f"Invalid Content-Length header: {content_length[:32]!r}.")
            if int(content_length) > self.max_bytes:
                raise self._too_large()
        try:
            return await asyncio.wait_for(self._read(receive), self.timeout_s or None)
        except asyncio.TimeoutError:
            raise ApiError(408, f"The request body did not arrive within {self.timeout_key} "
                                f"({self.timeout_s:g} s).", code="request_timeout") from None

    async def _read(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"The request body is larger than {self.max_bytes} bytes "
                             "(server.max_request_body_bytes).", code="request_too_large")


class ConcurrencyLimit:
    """At most `limit` requests (0 = no limit) inside every ASGI app that `wrap` returned, together,
    each counted once its body (read under `body`) is in. `admit` runs first, before anything is
    read: the API key and draining checks, so a client without a key cannot make us buffer bodies;
    it may return a function called once the request has ended, however it ended."""

    def __init__(self, limit: int, body: BodyLimits,
                 admit: Callable[[Request], Optional[Callable[[], None]]] = lambda r: None) -> None:
        self.limit = limit
        self.body = body
        self.admit = admit
        self.active = 0
        self.reading = 0  # requests whose body is being read (they hold no slot), for tests and logs
        self.refused = 0  # total 429s given, for tests and logs

    def wrap(self, app: ASGIApp) -> ASGIApp:
        # An instance, not a function: Starlette's Route would take a function for a request handler.
        return _Limited(app, self)

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            release = self.admit(Request(scope))
        except ApiError as e:
            await e.response()(scope, receive, send)
            return
        try:
            await self._run(app, scope, receive, send)
        finally:
            if release is not None:  # e.g. the tenant's concurrency slot (server/tenants.py)
                release()

    async def _run(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        if self._full():  # refused before the body is read: a flood costs us nothing
            await self._refuse(scope, receive, send)
            return
        self.reading += 1
        try:
            body = await self.body.read(receive, _header(scope, b"content-length"))
        except ApiError as e:
            await e.response()(scope, receive, send)
            return
        except ClientDisconnect:
            return  # nobody to answer
        finally:
            self.reading -= 1
        if self._full():
            await self._refuse(scope, receive, send)
            return
        self.active += 1
        try:
            await app(scope, _replay(body, receive), send)
        finally:
            self.active -= 1

    def _full(self) -> bool:
        return bool(self.limit) and self.active >= self.limit

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.refused += 1
        err = too_many(f"Too many concurrent requests: the server handles at most {self.limit} at once "
                       f"(server.max_concurrent_requests); retry after {RETRY_AFTER_S} s.",
                       "too_many_requests")
        await err.response()(scope, receive, send)


def _header(scope: Scope, name: bytes) -> Optional[str]:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """An ASGI receive that hands the app the body already read, then the client's own messages
    (so the app still sees `http.disconnect`)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


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

    def error(self) -> ApiError:
        """The 504 for a request past its deadline (the caller aborts it)."""
        return ApiError(504, f"The request took longer than server.request_timeout_s ({self.timeout_s:g} s) "
                             "and was aborted.", code="timeout")
