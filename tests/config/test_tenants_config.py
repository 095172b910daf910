"""The tenants group: the shipped files compose, tenants are applied live (not restart-only settings),
and `appliance config show` never prints a tenant's key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.config.compose import compose_tree
from appliance.config.restart import restart_settings
from appliance.config.schema import ConfigError
from tests.conftest import REPO

KEYS = {"TEAM_A_KEY": "team-a-secret-0123456789", "TEAM_B_KEY": "team-b-secret-0123456789"}


def test_default_is_empty_and_two_teams_composes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compose_tree(REPO / "configs").cfg.tenants == {}
    for k, v in KEYS.items():
        monkeypatch.setenv(k, v)
    composed = compose_tree(REPO / "configs", ["tenants=two_teams"])
    t = composed.cfg.tenants
    assert sorted(t) == ["team-a", "team-b"] and t["team-b"].admin == "read" and t["team-b"].weight == 2
    assert composed.env.keys["tenants.team-a.keys"] == ("TEAM_A_KEY",)
    assert not any(k.startswith("tenants") for k in restart_settings(composed.cfg, in_process=True))
    assert KEYS["TEAM_A_KEY"] not in repr(composed.cfg)


def test_config_show_masks_tenant_keys(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                       tmp_path: Path) -> None:
    for k, v in KEYS.items():
        monkeypatch.setenv(k, v)
    tree = Path(shutil.copytree(REPO / "configs", tmp_path / "configs"))
    text = (tree / "tenants" / "two_teams.yaml").read_text()
    (tree / "tenants" / "mixed.yaml").write_text(text + "lit:\n  keys: [literal-key-0123456789]\n")
    assert main(["config", "show", "--config-dir", str(tree), "tenants=mixed"]) == 0
    out = capsys.readouterr().out
    assert "team-a:" in out and "keys: <from env TEAM_A_KEY>" in out and "lit:" in out
    assert not any(v in out for v in [*KEYS.values(), "literal-key-0123456789"])


def test_a_key_shared_by_two_tenants_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_A_KEY", "same-key-0123456789")
    monkeypatch.setenv("TEAM_B_KEY", "same-key-0123456789")
    with pytest.raises(ConfigError, match="tenants/two_teams.yaml: tenants.team-b: shares a key with tenants.team-a"):
        compose_tree(REPO / "configs", ["tenants=two_teams"])
