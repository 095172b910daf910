from __future__ import annotations

from appliance.reconcile.plan import AdapterState, plan, render


def st(name: str, path: str = "/a", pinned: bool = False, checksum: str = "c" * 64) -> AdapterState:
    return AdapterState(name, path, pinned, checksum)


def test_no_changes() -> None:
    same = {"a": st("a")}
    assert plan(same, dict(same)) == []
    assert render([]) == "No changes. The live adapters match the config."


def test_every_kind_in_safe_order_with_reasons() -> None:
    desired = {"new": st("new", pinned=True), "moved": st("moved", path="/b"), "retrained": st("retrained", checksum="d" * 64),
               "pin": st("pin", pinned=True), "unpin": st("unpin"), "same": st("same")}
    live = {"old": st("old"), "moved": st("moved"), "retrained": st("retrained"), "pin": st("pin"),
            "unpin": st("unpin", pinned=True), "same": st("same")}
    actions = plan(desired, live)
    assert [(a.kind, a.name) for a in actions] == [
        ("unload", "old"), ("reload", "moved"), ("reload", "retrained"), ("load", "new"), ("unpin", "unpin"),
        ("pin", "pin")]
    text = render(actions).splitlines()
    assert text[0] == "- old: unload (not in the config)"
    assert text[1] == "-/+ moved: reload (path changed: /a -> /b)"
    assert text[2].startswith("-/+ retrained: reload (weights changed: checksum cccccccccccc -> dddddddddddd")
    assert text[3] == "+ new: load (not loaded (/a, pinned))"
    assert text[-1] == "Plan: 1 to load, 2 to reload, 1 to unload, 2 to pin/unpin."


def test_path_change_wins_over_pin_change() -> None:
    actions = plan({"a": st("a", path="/b", pinned=True)}, {"a": st("a")})
    assert [a.kind for a in actions] == ["reload"] and actions[0].desired.pinned
