"""`appliance status`: a running server's /v1/status and /v1/adapters as text for a terminal."""

from __future__ import annotations

from typing import Any, Optional


def render_status(url: str, status: Optional[dict[str, Any]], adapters: dict[str, Any]) -> str:
    lines = [f"server: {url}"]
    if status is None:
        lines.append("status: not available (this server has no /v1/status)")
    else:
        c = status["config"]
        lines.append(f"config: generation {c['generation']}, hash {c['hash']}, dir {c['dir'] or '-'}, "
                     f"watch {'on' if c['watch'] else 'off'}, resync {c['resync_s']:g} s, "
                     f"prune {c['prune']}")
        for cond in status["conditions"]:
            lines.append(f"  {cond['type']}: {cond['status']} ({cond['reason']}) since "
                         f"{cond['last_transition_time']}: {cond['message']}")
        last = status["last_reconcile"]
        lines.append(f"last reconcile: {last['result']} ({last['trigger']}) at {last['at']}, "
                     f"{len(last['actions'])} action(s), {last['duration_s'] * 1000:.0f} ms")
        lines += [f"  {a['action']} {a['name']}: {a['result']}" + (f": {a['error']}" if a["error"] else "")
                  for a in last["actions"]]
        lines += [f"  ! {r}" for r in status["restart_required"]]
        if status.get("runtime"):
            lines.append("runtime: " + _flat(status["runtime"]))
    if not adapters.get("enabled"):
        lines.append("adapters: LoRA serving is off (lora.enabled is false)")
        return "\n".join(lines)
    pool, cache = adapters["pool"], adapters["cache"]
    lines.append(f"GPU slots: {pool['used']}/{pool['slots']} used, {pool['pinned']} pinned "
                 f"(limit {pool['pinned_limit']}), {pool['evictions']} eviction(s); CPU tier: "
                 f"{cache['entries']}/{cache['capacity']}")
    rows = [("NAME", "TIER", "SLOT", "PINNED", "IN-FLIGHT", "RANK", "PATH")]
    rows += [(a["name"], a["tier"], "-" if a["slot"] is None else str(a["slot"]), "yes" if a["pinned"] else "no",
              str(a["in_flight"]), str(a["rank"]), a["path"]) for a in adapters["data"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    if not adapters["data"]:
        lines.append("(no adapters loaded)")
    return "\n".join(lines)


def _flat(d: dict[str, Any], prefix: str = "") -> str:
    """The resolved runtime settings as `key=value` pairs, nested keys dotted (lora.backend=triton)."""
    parts = []
    for k, v in d.items():
        if isinstance(v, dict):
            parts.append(_flat(v, f"{prefix}{k}."))
        elif v is not None:
            parts.append(f"{prefix}{k}={v}")
    return ", ".join(p for p in parts if p)
