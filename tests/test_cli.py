"""The `appliance` CLI as a user runs it: a subprocess, its exit code, its stdout and stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_config_show_prints_composed_yaml() -> None:
    r = run_cli("config", "show", "server.port=9000", "server.admin_key=topsecret", "server.api_keys=[k1]")
    assert r.returncode == 0, r.stderr
    assert "port: 9000" in r.stdout and "name: SmolLM2-135M-Instruct" in r.stdout
    assert "topsecret" not in r.stdout and "k1" not in r.stdout  # keys are masked


def test_config_dir_option(tmp_path: Path) -> None:
    r = run_cli("config", "show", "--config-dir", str(tmp_path / "missing"))
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "config file not found" in r.stderr
    # A dir without config.yaml is an overrides dir over the packaged defaults (config/layers.py).
    r = run_cli("config", "show", "--config-dir", str(tmp_path))
    assert r.returncode == 0 and "name: SmolLM2-135M-Instruct" in r.stdout, r.stderr


def test_overrides_may_come_before_and_after_options() -> None:
    r = run_cli("config", "show", "server.port=1234", "--config-dir", str(REPO / "configs"), "server.port=4321")
    assert r.returncode == 0, r.stderr
    assert "port: 4321" in r.stdout  # Hydra order kept: the last override wins


def test_invalid_override_exits_1_naming_the_key() -> None:
    r = run_cli("config", "show", "model.foo=1")
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "model.foo" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("serve", "server.port=99999")  # fails at compose, before any server import
    assert r.returncode == 1 and "server.port" in r.stderr


def test_argument_errors_exit_2() -> None:
    assert run_cli().returncode == 2  # no command
    assert run_cli("config", "show", "--bogus").returncode == 2
    assert run_cli("model").returncode == 2  # no action
    r = run_cli("nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_model_prepare(tmp_path: Path, default_model_dir: Path) -> None:
    r = run_cli("model", "prepare", f"model.path={default_model_dir}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(default_model_dir)
    r = run_cli("model", "prepare", f"model.path={tmp_path / 'missing'}", "model.source=null")
    assert r.returncode == 1 and "model.path" in r.stderr
