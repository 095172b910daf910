"""Bearer keys: server.api_keys for the inference routes (empty = open), server.admin_key for the admin
routes (null = admin API off). Tenants' keys (tenants:) are checked in tenants.py."""

from __future__ import annotations

import hashlib
import hmac
from typing import Callable, Optional, Sequence

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
    """Constant-time comparison against every key (no early exit that would tell which one was close).
    Both sides are hashed first: compare_digest hides the content but not the length of its inputs,
    and digests all have the same length."""
    ok = False
    digest = hashlib.sha256(token).digest()
    for key in keys:
        ok |= hmac.compare_digest(digest, hashlib.sha256(key).digest())
    return ok


class AdminAuth:
    """The admin routes' keys: server.admin_key (every route), and tenants' keys by their `admin` role:
    `read` (GET /v1/adapters, /v1/status: what `appliance plan` needs), `admin` (also load, unload,
    pin, apply). No admin key and no tenant with a role = the admin API is off: 403, whatever is sent.
    `role_of(token)`: the role of the tenant whose key it is, None for no tenant's key."""

    def __init__(self, key: str | None,
                 role_of: Callable[[bytes], Optional[str]] = lambda token: None,
                 any_role: Callable[[], bool] = lambda: False) -> None:
        self._key = None if key is None else key.encode("utf-8")
        self._role_of = role_of
        self._any_role = any_role

    def check(self, request: Request, need: str = "admin") -> None:
        """Raise ApiError unless the request's key may call a route that needs role `need` (read | admin)."""
        if self._key is None and not self._any_role():
            raise ApiError(403, "The admin API is disabled: server.admin_key is not set. Set it "
                                "(e.g. APPLIANCE_ADMIN_KEY) and restart to use the admin routes.",
                           code="admin_disabled")
        token = bearer_token(request)
        if token is None:
            raise ApiError(401, "Missing admin key: send 'Authorization: Bearer <server.admin_key>'.",
                           code="invalid_admin_key", headers={"WWW-Authenticate": "Bearer"})
        if self._key is not None and keys_match(token, [self._key]):
            return
        role = self._role_of(token)
        if role == "admin" or (role == "read" and need == "read"):
            return
        if role is not None:  # a known key without the role: forbidden, not unauthenticated
            raise ApiError(403, f"This key's admin role is {role!r}; this route needs {need!r}.",
                           code="insufficient_role")
        raise ApiError(401, "Incorrect admin key provided.", code="invalid_admin_key",
                       headers={"WWW-Authenticate": "Bearer"})
