"""Hold a live server's engine thread between two steps, through its own `AsyncEngine.call`.

While held, nothing steps: requests already inside the server stay there, deterministically, so a test
can fill a limit without racing the engine's speed. Nothing is mocked: the engine runs a callable
between steps exactly as an admin operation does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Iterator

from appliance.engine.async_engine import AsyncEngine


@contextlib.contextmanager
def engine_held(engine: AsyncEngine, timeout_s: float = 120.0) -> Iterator[None]:
    entered, release = threading.Event(), threading.Event()

    def block() -> None:
        entered.set()
        release.wait(timeout_s)

    t = threading.Thread(target=lambda: asyncio.run(engine.call(block)), daemon=True)
    t.start()
    assert entered.wait(30), "the engine thread never ran the hold"
    try:
        yield
    finally:
        release.set()
        t.join(30)
