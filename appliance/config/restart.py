"""Which settings a running server applies live and which need a restart.

Only the adapter inventory (`adapters:`), the tenants (`tenants:`) and `reconcile.prune` are applied live. Everything else sizes
or shapes the engine (model, dtype, slots, max rank, target modules, backend, tp layout, KV cache) or
the process (port, keys, watcher): changing it live would mean rebuilding the engine under running
requests, so the reconciler reports it as "requires restart" and never half-applies it.

Settings are compared as flat `section.key` -> value maps. The server shows its map in /v1/status so
`appliance plan` can compare from outside; secrets are left out of that map and compared only in-process,
and a value from the environment (`${oc.env:...}`) shows as `<from env VAR>` there and in every
rendered change (config/env.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import OmegaConf

from appliance.config.env import NO_ENV, EnvOrigins
from appliance.config.schema import ApplianceConfig

LIVE_KEYS = frozenset({"reconcile.prune"})
SECRET_KEYS = frozenset({"server.api_keys", "server.admin_key", "tracing.headers"})
# Compared in-process only. From outside, the address a client reaches is not the one the server
# binds (port 0, 0.0.0.0, Docker port maps, port-forwards), and the reconcile settings are how that
# server follows its own dir (often set by its command line), so a difference there means nothing.
LOCAL_KEYS = frozenset({"server.host", "server.port"})
LOCAL_SECTIONS = ("reconcile.",)


@dataclass(frozen=True)
class SettingChange:
    key: str
    live: Any
    wanted: Any
    env: tuple[str, ...] = ()  # the variables either side's value came from

    def render(self) -> str:
        if self.key in SECRET_KEYS:
            return f"{self.key}: changed (requires restart)"  # never echo a key
        if self.env:
            return f"{self.key}: changed (from env {', '.join(self.env)}; requires restart)"
        return f"{self.key}: {_show(self.live)} -> {_show(self.wanted)} (requires restart)"


def restart_settings(cfg: ApplianceConfig, in_process: bool = False, env: EnvOrigins = NO_ENV) -> dict[str, Any]:
    """Every restart-only setting of `cfg` as `section.key` -> plain value (lists stay lists).
    Secrets and the listen address only `in_process` (the server comparing its own two configs), and
    only then are values from the environment (`env`) kept: elsewhere they read `<from env VAR>`."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(data, dict)
    out: dict[str, Any] = {}
    for section, values in data.items():
        if section in ("adapters", "tenants") or not isinstance(values, dict):  # both applied live
            continue
        for key, value in values.items():
            path = f"{section}.{key}"
            local = path in SECRET_KEYS or path in LOCAL_KEYS or path.startswith(LOCAL_SECTIONS)
            if path in LIVE_KEYS or (local and not in_process):
                continue
            out[path] = value if in_process else env.mask(path, value)
    return out


def mask_override(override: str) -> str:
    """A Hydra override as /v1/status may show it: the value of a secret key becomes ***. Overrides are
    shown as typed, so `server.admin_key=${oc.env:KEY}` is harmless; a key typed literally is not."""
    key, sep, _ = override.partition("=")
    return f"{key}=***" if sep and key.lstrip("+~") in SECRET_KEYS else override


def restart_diff(live: Mapping[str, Any], wanted: Mapping[str, Any], env: EnvOrigins = NO_ENV) -> list[SettingChange]:
    """Settings that differ, sorted by key. A key only one side knows (an older server) is skipped.
    `env`: which keys came from the environment on either side (their change is rendered valueless)."""
    return [SettingChange(k, live[k], wanted[k], env.keys.get(k, ())) for k in sorted(live.keys() & wanted.keys())
            if live[k] != wanted[k]]


def _show(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
