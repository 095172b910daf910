"""Process logging: one handler on the root logger, text or JSON (logging.format).

JSON goes through python-json-logger, a formatter for the standard library's logging, so every
existing `logging.getLogger(...)` line (the request lines of server/request_log.py included, with their
fields) becomes one JSON object a line with no change at the call sites. uvicorn's own loggers then
propagate to the same handler and its access log is off: the request line replaces it.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Optional

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER_NAME = "appliance"


def log_level(level: str) -> str:
    """server.log_level (uvicorn's names) as the standard library's level name."""
    return {"trace": "DEBUG"}.get(level.lower(), level.upper())


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                             rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})
    return logging.Formatter(TEXT_FORMAT)


def setup_logging(level: str, fmt: str, stream: Optional[IO[str]] = None) -> None:
    """Install (or replace) the appliance's root handler at `level` with format `fmt` (text | json)."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter(fmt))
    root.addHandler(handler)
    root.setLevel(log_level(level))
