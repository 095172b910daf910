"""The admin API from outside the server: what `appliance plan | apply | status` talk to.

Plain urllib (no extra dependency); every failure becomes AdminClientError with the route, the HTTP
status and the server's OpenAI-shaped message, so the CLI can print one clear line.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any, Optional


class AdminClientError(Exception):
    """A refused or failed admin call; `status` is the HTTP code (0 when the server was unreachable)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class AdminClient:
    def __init__(self, url: str, admin_key: Optional[str], timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.key = admin_key
        self.timeout_s = timeout_s

    # -------------------------------------------------------------------- reads
    def adapters(self) -> dict[str, Any]:
        return self._call("GET", "/v1/adapters")

    def status(self) -> Optional[dict[str, Any]]:
        """GET /v1/status, or None from a server that has no such route (404)."""
        try:
            return self._call("GET", "/v1/status")
        except AdminClientError as e:
            if e.status == 404:
                return None
            raise

    # -------------------------------------------------------------------- the reconciler's operations
    # async so that apply.execute drives this client and the in-process one alike.
    async def load(self, name: str, path: str, pinned: bool, inplace: bool, managed: bool = False) -> None:
        await asyncio.to_thread(self._call, "POST", "/v1/load_lora_adapter",
                                {"lora_name": name, "lora_path": path, "pinned": pinned, "load_inplace": inplace,
                                 "managed": managed})

    async def unload(self, name: str) -> None:
        await asyncio.to_thread(self._call, "POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def set_pinned(self, name: str, pinned: bool, managed: Optional[bool] = None) -> None:
        body: dict[str, Any] = {"lora_name": name, "pinned": pinned}
        if managed is not None:
            body["managed"] = managed
        await asyncio.to_thread(self._call, "POST", "/v1/pin_lora_adapter", body)

    # -------------------------------------------------------------------- transport
    def _call(self, method: str, route: str, body: Optional[dict] = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.key:
            req.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = e.reason
            raise AdminClientError(f"{route} answered {e.code}: {msg}", e.code) from None
        except (urllib.error.URLError, OSError) as e:
            raise AdminClientError(f"cannot reach {self.url}: {getattr(e, 'reason', e)}") from None
