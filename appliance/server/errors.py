"""The OpenAI error shape, used for every error the server answers (also on /generate and /health).

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Handlers raise `ApiError`; app.py turns it (and Starlette's own 404/405) into this JSON.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping, Optional, Sequence

from starlette.responses import JSONResponse

from appliance.lora.names import cut, shown

# HTTP status -> the OpenAI error `type`.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "server_error",
}


class ApiError(Exception):
    """An error answered to the client with `status` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[Mapping[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as one SSE event, for failures after a stream has started (status already 200)."""
        return f"data: {json.dumps(self.body())}\n\n"


def unknown_fields(unknown: Sequence[str], known: Iterable[str], where: str) -> ApiError:
    """400 for body keys `where` does not take; the keys repeated cut and at most 5 of them."""
    listed = ", ".join(shown(k) for k in unknown[:5]) + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else "")
    return bad_request(f"Unknown field(s) [{listed}]; {where} takes {sorted(known)}.", cut(unknown[0]))


def bad_request(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param)


def error_body(status: int, message: str, *, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
