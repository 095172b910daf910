"""The diff of desired adapters against live ones, as an ordered list of actions. Pure Python.

Order is the safe order to apply in, the one that never exceeds the slot or pin limits: unpins first
(they free pin budget), then unloads (they free slots and pins), then reloads, then loads (a pinned
load takes a slot and a pin), then pins (a pin needs its adapter loaded and a slot free), then adopts
(the config takes ownership of a matching adapter that the admin API loaded; nothing is reloaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from appliance.config.restart import SettingChange


@dataclass(frozen=True)
class AdapterState:
    """One adapter as the config wants it or as the server has it."""

    name: str
    path: str  # resolved
    pinned: bool
    checksum: str  # sha256 of adapter_config.json + adapter_model.safetensors
    # Owned by the config (declared there, now or before): what `prune: owned` may unload. Adapters
    # loaded only through the admin API are unmanaged.
    managed: bool = True
    revision: str = ""  # a remote adapter's resolved revision (etag:..., commit:...); "" for a local dir

    @property
    def shown(self) -> str:
        """The path, and a remote adapter's revision, as plan lines show them."""
        return f"{self.path} at {self.revision}" if self.revision else self.path


@dataclass(frozen=True)
class Action:
    kind: str  # load | unload | reload | pin | unpin | adopt
    name: str
    reason: str
    desired: Optional[AdapterState] = None  # what load/reload/pin apply

    @property
    def symbol(self) -> str:
        return {"load": "+", "unload": "-", "reload": "-/+", "pin": "~", "unpin": "~", "adopt": "~"}[self.kind]


@dataclass
class Plan:
    actions: list[Action]
    # Live adapters not in the config, left alone because pruning is off.
    kept: list[str] = field(default_factory=list)
    # Live adapters not in the config that it never declared (loaded through the admin API), left
    # alone by `prune: owned`.
    unmanaged: list[str] = field(default_factory=list)
    # Config adapters that cannot be planned (their files fail the checks against the live engine):
    # name -> why. A live adapter of that name is left as it is, never unloaded for it.
    broken: dict[str, str] = field(default_factory=dict)
    # Engine-level settings that differ: reported, never applied live.
    restart: list[SettingChange] = field(default_factory=list)

    @property
    def has_changes(self) -> bool:
        """Live differs from the config in any way (what `--detailed-exitcode` reports as 2)."""
        return bool(self.actions or self.restart or self.broken)


ORDER = {"unpin": 0, "unload": 1, "reload": 2, "load": 3, "pin": 4, "adopt": 5}


def plan(desired: dict[str, AdapterState], live: dict[str, AdapterState], prune: str = "owned",
         broken: Optional[dict[str, str]] = None, restart: Optional[list[SettingChange]] = None) -> Plan:
    """`prune`: reconcile.prune, "owned" | "all" | "none" (what happens to live adapters the config
    does not list)."""
    broken = dict(broken or {})
    actions: list[Action] = []
    drift = sorted(live.keys() - desired.keys() - broken.keys())
    unmanaged = [n for n in drift if not live[n].managed] if prune == "owned" else []
    kept = drift if prune == "none" else []
    actions += [Action("unload", name, "not in the config") for name in drift
                if name not in unmanaged and name not in kept]
    for name in sorted(desired.keys() - live.keys()):
        d = desired[name]
        actions.append(Action("load", name, f"not loaded ({d.shown}{', pinned' if d.pinned else ''})", d))
    for name in sorted(desired.keys() & live.keys()):
        d, l = desired[name], live[name]
        if d.path != l.path:
            actions.append(Action("reload", name, f"path changed: {l.path} -> {d.path}", d))
        elif d.checksum != l.checksum:
            moved = f"; revision {l.revision} -> {d.revision}" if l.revision != d.revision else ""
            actions.append(Action("reload", name, f"weights changed: checksum {l.checksum[:12]} -> "
                                  f"{d.checksum[:12]}{moved}", d))
        elif d.pinned != l.pinned:
            actions.append(Action("pin" if d.pinned else "unpin", name, f"pinned: {l.pinned} -> {d.pinned}", d))
        elif not l.managed and prune == "owned":  # ownership matters only to prune: owned
            actions.append(Action("adopt", name, "declared in the config, loaded through the admin API", d))
    actions.sort(key=lambda a: (ORDER[a.kind], a.name))
    return Plan(actions, kept=kept, unmanaged=unmanaged, broken=broken, restart=list(restart or []))


def render(p: Plan) -> str:
    """Terraform-style: one line per action with its reason, then notes, then a summary line."""
    lines = [f"{a.symbol} {a.name}: {a.kind} ({a.reason})" for a in p.actions]
    lines += [f"! {name}: cannot be planned: {why}" for name, why in sorted(p.broken.items())]
    lines += [f"= {name}: kept (live but not in the config; pruning is off)" for name in p.kept]
    lines += [f"= {name}: unmanaged (loaded through the admin API; kept, reconcile.prune is owned)"
              for name in p.unmanaged]
    lines += [f"! {c.render()}" for c in p.restart]
    count = {k: sum(a.kind == k for a in p.actions) for k in ORDER}
    if not p.has_changes:
        lines.append("No changes. The live adapters match the config.")
    else:
        summary = (f"Plan: {count['load']} to load, {count['reload']} to reload, {count['unload']} to unload, "
                   f"{count['pin'] + count['unpin']} to pin/unpin.")
        if count["adopt"]:
            summary += f" {count['adopt']} to adopt."
        if p.restart:
            summary += f" {len(p.restart)} setting(s) need a restart (not applied live)."
        if p.broken:
            summary += f" {len(p.broken)} adapter(s) cannot be planned."
        lines.append(summary)
    return "\n".join(lines)
