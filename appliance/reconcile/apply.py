"""Execute a plan's actions through admin operations, one at a time, in the plan's safe order.

The same code runs in `appliance apply` (ops = the HTTP admin client) and in the server's hot reload
(ops = the in-process admin operations the HTTP routes use). An action that fails is recorded and the
others still run: each operation is atomic on the server (a refused load changes nothing), so the live
state stays consistent and the next reconcile retries what failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from appliance.reconcile.plan import Action


class AdapterOps(Protocol):
    """`managed=True`: the config owns the adapter (what `reconcile.prune: owned` may unload)."""

    async def load(self, name: str, path: str, pinned: bool, inplace: bool, managed: bool) -> Any: ...
    async def unload(self, name: str) -> Any: ...
    async def set_pinned(self, name: str, pinned: bool, managed: Optional[bool]) -> Any: ...


@dataclass(frozen=True)
class ActionResult:
    action: Action
    error: Optional[str] = None  # None = done

    @property
    def ok(self) -> bool:
        return self.error is None

    def render(self) -> str:
        a = self.action
        return f"{a.symbol} {a.name}: {a.kind} " + ("done" if self.ok else f"FAILED: {self.error}")


async def execute(actions: list[Action], ops: AdapterOps) -> list[ActionResult]:
    results = []
    for a in actions:
        try:
            await _run(a, ops)
        except Exception as e:  # noqa: BLE001 - any failure is this action's result, the rest still run
            results.append(ActionResult(a, _message(e)))
        else:
            results.append(ActionResult(a))
    return results


async def _run(a: Action, ops: AdapterOps) -> None:
    if a.kind == "unload":
        await ops.unload(a.name)
        return
    assert a.desired is not None
    if a.kind in ("load", "reload"):
        await ops.load(a.name, a.desired.path, pinned=a.desired.pinned, inplace=a.kind == "reload", managed=True)
    else:  # pin, unpin, adopt: the pin the config wants, and the config's ownership
        await ops.set_pinned(a.name, a.desired.pinned, managed=True)


def _message(e: Exception) -> str:
    return getattr(e, "message", None) or str(e) or type(e).__name__
