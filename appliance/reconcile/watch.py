"""Hot reload: watch the config dir and resync periodically, calling the reconciler.

The directory is watched, not single files, so every way a config changes is seen: in-place writes,
editors' write-to-temp-then-rename saves, and Kubernetes ConfigMap updates (the mounted files are
symlinks through `..data`, and an update swaps that symlink to a new timestamped dir). Events are
debounced (editors and the kubelet write in several steps) and every event just asks for a reconcile:
the reconciler composes the tree and stops at once when its hash is unchanged, so spurious events
(swap files, atime-only changes) cost one compose. The periodic resync repairs drift and covers events
a watcher can miss (network filesystems, a dir replaced wholesale).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from appliance.reconcile.controller import Reconciler

log = logging.getLogger(__name__)


async def run_watch(reconciler: Reconciler, config_dir: Path, debounce_s: float, stop: asyncio.Event) -> None:
    """Reconcile after each debounced batch of file events under `config_dir` until `stop` is set."""
    from watchfiles import awatch

    log.info("watching %s for config changes", config_dir)
    async for changes in awatch(config_dir, debounce=max(1, int(debounce_s * 1000)), step=50,
                                stop_event=stop, watch_filter=None, recursive=True, rust_timeout=1000,
                                yield_on_timeout=False):
        log.info("config dir changed (%d event(s)): reconciling", len(changes))
        await _guarded(reconciler, "watch")


async def run_resync(reconciler: Reconciler, period_s: float, stop: asyncio.Event) -> None:
    """Reconcile every `period_s` seconds until `stop` is set."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=period_s)
            return
        except asyncio.TimeoutError:
            await _guarded(reconciler, "resync")


async def _guarded(reconciler: Reconciler, trigger: str) -> None:
    # A bug in one pass must not end hot reload for the life of the server: log it, keep watching.
    try:
        await reconciler.reconcile(trigger)
    except Exception:  # noqa: BLE001
        log.exception("reconcile (%s) raised; the previous state keeps serving", trigger)
