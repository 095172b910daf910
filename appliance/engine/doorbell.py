"""The engine loop's wake-up: one condition that callers, and the LoRA reader threads, notify.

Created by LLMEngine before its LoRA manager, whose background reads ring it as they end, and used by
AsyncEngine as its lock and condition: every collaborator gets it at construction. Pure Python.
"""

from __future__ import annotations

import threading


class Doorbell:
    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.rings = 0  # background reads ended so far, under cond's lock

    def ring(self) -> None:
        """A background adapter read ended (called on its reader thread): wake whoever waits."""
        with self.cond:
            self.rings += 1
            self.cond.notify_all()
