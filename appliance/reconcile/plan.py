"""The diff of desired adapters against live ones, as an ordered list of actions. Pure Python.

Order is the safe order to apply in: unloads first (they free slots and pins), then reloads, then
loads, then pin changes (a pin needs its adapter loaded and a slot free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AdapterState:
    """One adapter as the config wants it or as the server has it."""

    name: str
    path: str  # resolved
    pinned: bool
    checksum: str  # sha256 of adapter_config.json + adapter_model.safetensors


@dataclass(frozen=True)
class Action:
    kind: str  # load | unload | reload | pin | unpin
    name: str
    reason: str
    desired: Optional[AdapterState] = None  # what load/reload/pin apply

    @property
    def symbol(self) -> str:
        return {"load": "+", "unload": "-", "reload": "-/+", "pin": "~", "unpin": "~"}[self.kind]


_ORDER = {"unload": 0, "reload": 1, "load": 2, "unpin": 3, "pin": 4}


def plan(desired: dict[str, AdapterState], live: dict[str, AdapterState]) -> list[Action]:
    actions: list[Action] = []
    for name in sorted(live.keys() - desired.keys()):
        actions.append(Action("unload", name, "not in the config"))
    for name in sorted(desired.keys() - live.keys()):
        d = desired[name]
        actions.append(Action("load", name, f"not loaded ({d.path}{', pinned' if d.pinned else ''})", d))
    for name in sorted(desired.keys() & live.keys()):
        d, l = desired[name], live[name]
        if d.path != l.path:
            actions.append(Action("reload", name, f"path changed: {l.path} -> {d.path}", d))
        elif d.checksum != l.checksum:
            actions.append(Action("reload", name, f"weights changed: checksum {l.checksum[:12]} -> {d.checksum[:12]}",
                                  d))
        elif d.pinned != l.pinned:
            actions.append(Action("pin" if d.pinned else "unpin", name, f"pinned: {l.pinned} -> {d.pinned}", d))
    return sorted(actions, key=lambda a: (_ORDER[a.kind], a.name))


def render(actions: list[Action]) -> str:
    """Terraform-style: one line per action with its reason, then a summary line."""
    lines = [f"{a.symbol} {a.name}: {a.kind} ({a.reason})" for a in actions]
    count = {k: sum(a.kind == k for a in actions) for k in _ORDER}
    if not actions:
        lines.append("No changes. The live adapters match the config.")
    else:
        lines.append(f"Plan: {count['load']} to load, {count['reload']} to reload, {count['unload']} to unload, "
                     f"{count['pin'] + count['unpin']} to pin/unpin.")
    return "\n".join(lines)
