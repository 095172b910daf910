"""Bearer API keys for the inference routes (server.api_keys; empty = open)."""

from __future__ import annotations

import hmac
from typing import Sequence

from starlette.requests import Request

from appliance.server.errors import ApiError


class ApiKeyAuth:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [k.encode("utf-8") for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, request: Request) -> None:
        """Raise ApiError 401 unless the request carries `Authorization: Bearer <one of the keys>`."""
        if not self._keys:
            return
        token = bearer_token(request)
        if token is None:
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not keys_match(token, self._keys):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


def bearer_token(request: Request) -> bytes | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    # Starlette decodes header bytes as latin-1; undo that to compare the bytes the client sent.
    return token.encode("latin-1")


def keys_match(token: bytes, keys: Sequence[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit that would tell which one was close)."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok
