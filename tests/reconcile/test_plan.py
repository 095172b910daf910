from __future__ import annotations

from appliance.config.restart import SettingChange
from appliance.reconcile.plan import AdapterState, plan, render


def st(name: str, path: str = "/a", pinned: bool = False, checksum: str = "c" * 64,
       managed: bool = True) -> AdapterState:
    return AdapterState(name, path, pinned, checksum, managed)


def test_no_changes() -> None:
    same = {"a": st("a")}
    p = plan(same, dict(same))
    assert p.actions == [] and not p.has_changes
    assert render(p) == "No changes. The live adapters match the config."


def test_every_kind_in_safe_order_with_reasons() -> None:
    desired = {"new": st("new", pinned=True), "moved": st("moved", path="/b"), "retrained": st("retrained", checksum="d" * 64),
               "pin": st("pin", pinned=True), "unpin": st("unpin"), "same": st("same")}
    live = {"old": st("old"), "moved": st("moved"), "retrained": st("retrained"), "pin": st("pin"),
            "unpin": st("unpin", pinned=True), "same": st("same")}
    p = plan(desired, live)
    # unpin before unload before reload before load before pin: never over the slot or pin limits.
    assert [(a.kind, a.name) for a in p.actions] == [
        ("unpin", "unpin"), ("unload", "old"), ("reload", "moved"), ("reload", "retrained"), ("load", "new"),
        ("pin", "pin")]
    text = render(p).splitlines()
    assert text[0] == "~ unpin: unpin (pinned: True -> False)"
    assert text[1] == "- old: unload (not in the config)"
    assert text[2] == "-/+ moved: reload (path changed: /a -> /b)"
    assert text[3].startswith("-/+ retrained: reload (weights changed: checksum cccccccccccc -> dddddddddddd")
    assert text[4] == "+ new: load (not loaded (/a, pinned))"
    assert text[-1] == "Plan: 1 to load, 2 to reload, 1 to unload, 2 to pin/unpin."


def test_path_change_wins_over_pin_change() -> None:
    p = plan({"a": st("a", path="/b", pinned=True)}, {"a": st("a")})
    assert [a.kind for a in p.actions] == ["reload"] and p.actions[0].desired.pinned


def test_no_prune_keeps_drift_and_says_so() -> None:
    p = plan({"a": st("a")}, {"a": st("a"), "extra": st("extra")}, prune="none")
    assert p.actions == [] and p.kept == ["extra"] and not p.has_changes
    assert render(p).splitlines() == ["= extra: kept (live but not in the config; pruning is off)",
                                      "No changes. The live adapters match the config."]


def test_prune_owned_unloads_only_what_the_config_declared() -> None:
    # "api" was loaded through the admin API, "gone" was declared by the config and left the file.
    live = {"api": st("api", managed=False), "gone": st("gone"), "a": st("a")}
    p = plan({"a": st("a")}, live, prune="owned")
    assert [(a.kind, a.name) for a in p.actions] == [("unload", "gone")]
    assert p.unmanaged == ["api"] and p.kept == []
    assert render(p).splitlines()[:2] == [
        "- gone: unload (not in the config)",
        "= api: unmanaged (loaded through the admin API; kept, reconcile.prune is owned)"]
    # The default is "owned"; "all" unloads the admin API's adapters too, "none" keeps both.
    assert [a.name for a in plan({"a": st("a")}, live).actions] == ["gone"]
    assert [a.name for a in plan({"a": st("a")}, live, prune="all").actions] == ["api", "gone"]
    p = plan({"a": st("a")}, live, prune="none")
    assert p.actions == [] and p.kept == ["api", "gone"]


def test_broken_adapter_is_reported_and_its_live_copy_kept() -> None:
    # A config adapter whose files fail the checks must not cause the live one of that name to unload.
    p = plan({}, {"a": st("a")}, broken={"a": "rank 32 > lora.max_lora_rank 16"})
    assert p.actions == [] and p.has_changes
    assert render(p).splitlines()[0] == "! a: cannot be planned: rank 32 > lora.max_lora_rank 16"


def test_restart_settings_are_listed_not_planned() -> None:
    p = plan({}, {}, restart=[SettingChange("lora.max_lora_rank", 16, 32),
                              SettingChange("server.admin_key", "old", "new")])
    assert p.actions == [] and p.has_changes
    lines = render(p).splitlines()
    assert lines[0] == "! lora.max_lora_rank: 16 -> 32 (requires restart)"
    assert lines[1] == "! server.admin_key: changed (requires restart)"  # never the key itself
    assert lines[-1].endswith("2 setting(s) need a restart (not applied live).")


def test_a_declared_adapter_the_api_loaded_is_adopted_only_under_prune_owned() -> None:
    live = {"a": st("a", managed=False)}
    p = plan({"a": st("a")}, live)
    assert [(a.kind, a.name) for a in p.actions] == [("adopt", "a")] and p.has_changes
    assert render(p).splitlines() == ["~ a: adopt (declared in the config, loaded through the admin API)",
                                      "Plan: 0 to load, 0 to reload, 0 to unload, 0 to pin/unpin. 1 to adopt."]
    assert plan({"a": st("a")}, live, prune="all").actions == []
