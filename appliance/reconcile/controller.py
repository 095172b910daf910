"""The in-process reconciler: keeps a running server's adapters in step with its config dir.

One reconcile = compose + validate the tree, stop if its hash is unchanged (file events only), report
restart-only differences, plan desired against live, execute the plan through the same admin
operations the HTTP routes use. One reconcile runs at a time, and admin API calls wait for its plan
and apply: both hold `ops.lock` (so a plan is never computed from a live state that changes under it).
Composing the YAML runs before that lock (a slow or hostile file never holds up the admin API).

An invalid config changes nothing: the previous adapters keep serving, ConfigValid turns False with
every problem (file and key), and the next valid save is picked up. Status follows Kubernetes-style
conditions: ConfigValid and Reconciled, each with a reason, a message and the time it last changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from appliance.config.compose import Composed, compose_tree, config_hash
from appliance.config.env import NO_ENV
from appliance.config.restart import SettingChange, mask_override, restart_diff, restart_settings
from appliance.config.schema import ApplianceConfig
from appliance.reconcile.apply import ActionResult, AdapterOps, execute
from appliance.reconcile.live import desired_state, live_adapters
from appliance.reconcile.plan import plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigSource:
    """Where the running config came from, so the reconciler can compose it again."""

    config_dir: Path
    overrides: tuple[str, ...] = ()
    layered: Optional[bool] = None  # an overrides dir over the packaged tree (config/layers.py); None = look


class LiveOps(AdapterOps, Protocol):
    lock: asyncio.Lock

    async def snapshot(self) -> dict[str, Any]: ...


@dataclass
class Condition:
    type: str
    status: bool
    reason: str
    message: str
    last_transition_time: float = field(default_factory=time.time)

    def view(self) -> dict[str, Any]:
        return {"type": self.type, "status": "True" if self.status else "False", "reason": self.reason,
                "message": self.message, "last_transition_time": _iso(self.last_transition_time)}


@dataclass
class ReconcileRecord:
    trigger: str  # start | watch | resync | manual
    result: str  # success | failed | invalid | unchanged
    started_at: float
    duration_s: float
    results: list[ActionResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        return {"trigger": self.trigger, "result": self.result, "at": _iso(self.started_at),
                "duration_s": round(self.duration_s, 4), "problems": self.problems,
                "actions": [{"action": r.action.kind, "name": r.action.name, "reason": r.action.reason,
                             "result": "done" if r.ok else "failed", "error": r.error} for r in self.results]}


class Reconciler:
    def __init__(self, running: ApplianceConfig, ops: LiveOps, source: Optional[ConfigSource],
                 runtime: Optional[dict[str, Any]] = None) -> None:
        self.running = running  # the config the engine was built from: restart-only settings come from it
        self.runtime = runtime  # the engine's settings with auto resolved at start (engine/runtime.py)
        self.ops = ops
        self.source = source
        self.generation = 1
        self.hash = config_hash(running)
        self.prune = running.reconcile.prune
        self.restart: list[SettingChange] = []
        # Values from ${oc.env:...} of the running config and the last composed one: never shown
        # (/v1/status, logs). The source composed again: `running` is already resolved.
        self.env_running = compose_tree(source.config_dir, source.overrides,
                                        layered=source.layered).env if source else NO_ENV
        self.env = self.env_running
        self._compose_lock = asyncio.Lock()  # composes in order, outside ops.lock (see reconcile)
        # The config dir watcher (reconcile/watch.py): off | watching | waiting (dir gone) | stopped.
        self.watcher: dict[str, Any] = {"state": "off", "message": "", "since": _iso(time.time())}
        now = time.time()
        self.conditions = {
            "ConfigValid": Condition("ConfigValid", True, "Started", "the config the server started with", now),
            "Reconciled": Condition("Reconciled", True, "Started", "adapters loaded at start", now),
        }
        self.last = ReconcileRecord("start", "success", now, 0.0)
        # Observers (metrics) called with each finished ReconcileRecord.
        self.listeners: list[Callable[[ReconcileRecord], None]] = []
        # Called with every valid composed config, before its plan: what is applied live besides
        # adapters (the tenants table, server/tenants.py).
        self.config_listeners: list[Callable[[ApplianceConfig], None]] = []

    # ------------------------------------------------------------------ entry points
    async def reconcile(self, trigger: str) -> ReconcileRecord:
        """Converge to the config dir now. `watch` stops early when the composed tree is unchanged
        and the last reconcile succeeded; `resync` and `manual` always plan (drift, changed weights).

        Composing (reading and parsing the YAML, checking the adapters' headers) runs before the admin
        lock is taken, so a slow or hostile file never holds up admin calls. Composes run one at a
        time, and each takes the admin lock before the next starts: passes apply in the order they
        read the dir.
        """
        t0, started = time.monotonic(), time.time()
        async with self._compose_lock:
            try:
                composed: Any = await self._compose()
            except Exception as e:  # noqa: BLE001 - reported below, under the lock, like any failure
                composed = e
            await self.ops.lock.acquire()
        try:
            if isinstance(composed, Exception):
                raise composed
            record = await self._reconcile(trigger, started, composed)
        except Exception as e:  # noqa: BLE001 - a bug or an unreadable file: report it, keep serving
            # The message redacted; the traceback (whose frames may hold values) only at debug level.
            log.error("reconcile (%s) raised %s", trigger, self.env.redact(f"{type(e).__name__}: {e}"))
            log.debug("reconcile (%s) traceback", trigger, exc_info=True)
            self._set("Reconciled", False, "Error", f"{type(e).__name__}: {e}")
            record = ReconcileRecord(trigger, "failed", started, 0.0, problems=[f"{type(e).__name__}: {e}"])
        finally:
            self.ops.lock.release()
        record.duration_s = time.monotonic() - t0
        self.last = record
        self._log(record)
        for fn in self.listeners:
            fn(record)
        return record

    def status(self) -> dict[str, Any]:
        return self.env.redact_all({
            "object": "status",
            "config": {"dir": str(self.source.config_dir) if self.source else None,
                       "overrides": [mask_override(o) for o in self.source.overrides] if self.source else [],
                       "generation": self.generation, "hash": self.hash,
                       "watch": bool(self.source) and self.running.reconcile.watch, "watcher": self.watcher,
                       "resync_s": self.running.reconcile.resync_s, "prune": self.prune},
            "conditions": [c.view() for c in self.conditions.values()],
            "last_reconcile": self.last.view(),
            "restart_required": [c.render() for c in self.restart],
            "settings": restart_settings(self.running, env=self.env_running),
            "runtime": self.runtime,
        })

    # ------------------------------------------------------------------ one pass
    async def _compose(self) -> Optional[tuple[Optional[Composed], list[str]]]:
        """The config dir composed and validated (None without a config dir), in a worker thread."""
        if self.source is None:
            return None
        from appliance.config.validate import validate_tree

        return await asyncio.to_thread(validate_tree, self.source.config_dir, list(self.source.overrides),
                                       self.source.layered)

    async def _reconcile(self, trigger: str, started: float,
                         validated: Optional[tuple[Optional[Composed], list[str]]]) -> ReconcileRecord:
        if validated is None:
            return ReconcileRecord(trigger, "unchanged", started, 0.0,
                                   problems=["no config dir: the server was started from a config object"])
        composed, problems = validated
        if problems or composed is None:
            self._set("ConfigValid", False, "Invalid", "; ".join(problems))
            return ReconcileRecord(trigger, "invalid", started, 0.0, problems=problems)
        cfg = composed.cfg
        self.env = self.env_running.merged(composed.env)
        new_hash = config_hash(cfg)
        unchanged = new_hash == self.hash
        if not unchanged:
            self.generation += 1
            self.hash = new_hash
        self._set("ConfigValid", True, "Valid", f"generation {self.generation}")
        for fn in self.config_listeners:
            fn(cfg)
        if trigger == "watch" and unchanged and self.conditions["Reconciled"].status:
            return ReconcileRecord(trigger, "unchanged", started, 0.0)
        self.prune = cfg.reconcile.prune
        self.restart = restart_diff(restart_settings(self.running, in_process=True),
                                    restart_settings(cfg, in_process=True), self.env)
        desired, broken = await asyncio.to_thread(desired_state, cfg, self.running)
        live = live_adapters(await self.ops.snapshot())
        p = plan(desired, live, prune=self.prune, broken=broken, restart=self.restart)
        results = await execute(p.actions, self.ops)
        failed = [r for r in results if not r.ok]
        problems = [f"{name}: {why}" for name, why in sorted(broken.items())]
        problems += [f"{r.action.name}: {r.action.kind} failed: {r.error}" for r in failed]
        if problems:
            self._set("Reconciled", False, "ActionsFailed", "; ".join(problems))
        elif self.restart:
            self._set("Reconciled", False, "RestartRequired",
                      "; ".join(c.render() for c in self.restart) + "; adapters are in step")
        else:
            self._set("Reconciled", True, "InSync", f"{len(results)} action(s) applied" if results
                      else "live adapters match the config")
        return ReconcileRecord(trigger, "failed" if problems else "success", started, 0.0, results, problems)

    def set_watcher(self, state: str, message: str) -> None:
        """What the config dir watcher does now, for /v1/status (`config.watcher`)."""
        if state != self.watcher["state"]:
            self.watcher = {"state": state, "message": message, "since": _iso(time.time())}

    def _set(self, type_: str, status: bool, reason: str, message: str) -> None:
        c = self.conditions[type_]
        if c.status != status or c.reason != reason:
            c.last_transition_time = time.time()
        c.status, c.reason, c.message = status, reason, message

    def _log(self, r: ReconcileRecord) -> None:
        redact = self.env.redact  # values from the environment never reach a log line
        if r.result == "invalid":
            for p in r.problems:
                log.error("config rejected, previous state keeps serving: %s", redact(p))
            return
        for res in r.results:
            (log.info if res.ok else log.error)("reconcile (%s): %s", r.trigger, redact(res.render()))
        for c in self.restart if r.result != "unchanged" else ():
            log.warning("config change not applied: %s", c.render())
        if r.result == "failed":
            log.error("reconcile (%s) failed: %s", r.trigger, redact("; ".join(r.problems)))


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))

