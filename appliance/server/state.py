"""The server's shared state: the reconciler, and the draining / started flags the probes answer from."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.reconcile.controller import Reconciler


@dataclass
class ServerState:
    """Shared with run.py: set `draining` on SIGTERM so /health and new requests answer 503; run.py
    also starts and stops hot reload around the reconciler."""

    reconciler: Reconciler
    draining: bool = False
    started: bool = False  # set by run.py once uvicorn listens (GET /ready)
