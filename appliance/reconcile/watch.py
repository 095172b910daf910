"""Hot reload: watch the config dir and resync periodically, calling the reconciler.

The directory is watched, not single files, so every way a config changes is seen: in-place writes,
editors' write-to-temp-then-rename saves, and Kubernetes ConfigMap updates (the mounted files are
symlinks through `..data`, and an update swaps that symlink to a new timestamped dir). Events are
debounced (editors and the kubelet write in several steps) and every event just asks for a reconcile:
the reconciler composes the tree and stops at once when its hash is unchanged, so spurious events
(swap files, atime-only changes) cost one compose. The periodic resync repairs drift and covers events
a watcher can miss (network filesystems, a dir replaced wholesale).

The watch is bound to the directory it was armed on: once that directory is deleted (or replaced by
another with the same name) the OS sends no more events for the path, and an unguarded watcher would
go deaf without a word. So the watcher checks every second that the path still names the directory
it watches; when it does not, it logs it, shows `waiting` in /v1/status (`config.watcher`), waits
for the directory to exist again, re-arms on it and reconciles (its content may have changed).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from appliance.reconcile.controller import Reconciler

log = logging.getLogger(__name__)


# How often the watcher checks that its directory is still there, and polls for it while it is not.
CHECK_S = 1.0


async def run_watch(reconciler: Reconciler, config_dir: Path, debounce_s: float, stop: asyncio.Event) -> None:
    """Reconcile after each debounced batch of file events under `config_dir` until `stop` is set,
    re-arming whenever the directory comes back after it was deleted or replaced."""
    armed_before = False
    while not stop.is_set():
        if not config_dir.is_dir():
            log.warning("config dir %s is gone: hot reload waits for it to come back", config_dir)
            reconciler.set_watcher("waiting", f"{config_dir} does not exist; hot reload resumes when it does")
            while not config_dir.is_dir():
                if await _stopped(stop, CHECK_S):
                    return
        identity = _identity(config_dir)
        if armed_before:
            log.warning("config dir %s is back: watching it again", config_dir)
        else:
            log.info("watching %s for config changes", config_dir)
        reconciler.set_watcher("watching", f"watching {config_dir}")
        if armed_before:
            await _guarded(reconciler, "watch")  # what it holds now may differ from before it went
        armed_before = True
        try:
            await _watch(reconciler, config_dir, identity, debounce_s, stop)
        except OSError as e:  # the dir vanished between the check and the arming: check again
            log.warning("watching %s failed (%s): trying again", config_dir, e)
            if await _stopped(stop, CHECK_S):
                break
    reconciler.set_watcher("stopped", "hot reload stopped")


async def _watch(reconciler: Reconciler, config_dir: Path, identity: tuple[int, int] | None, debounce_s: float,
                 stop: asyncio.Event) -> None:
    """One armed watch; returns when `stop` is set or the path no longer names the same directory."""
    from watchfiles import awatch

    async for changes in awatch(config_dir, debounce=max(1, int(debounce_s * 1000)), step=50,
                                stop_event=stop, watch_filter=None, recursive=True,
                                rust_timeout=int(CHECK_S * 1000), yield_on_timeout=True):
        if _identity(config_dir) != identity:
            return
        if changes:
            log.info("config dir changed (%d event(s)): reconciling", len(changes))
            await _guarded(reconciler, "watch")


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the directory `path` names now; None when there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


async def _stopped(stop: asyncio.Event, wait_s: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), timeout=wait_s)
        return True
    except asyncio.TimeoutError:
        return False


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
