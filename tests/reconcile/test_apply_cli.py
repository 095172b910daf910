"""`appliance plan | apply | status` against a live server: real engine, real uvicorn, peft adapters.

The server starts with the adapters of a config tree (two inventory files); the tree is then edited
and `plan` must show the diff without changing anything, `apply` must make the live state match
(idempotently), newly loaded adapters must answer exactly as peft does, and engine-level edits must be
reported as requiring a restart and never applied.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from appliance.cli import main
from appliance.config.compose import compose_config
from appliance.reconcile.controller import ConfigSource
from tests.lora.test_lora_engine import NEW, make_adapter, peft_greedy
from tests.reconcile.trees import admin, live, write_inventory, write_tree
from tests.server.conftest import ServerThread

PROMPT_IDS = [1, 504, 3458, 282, 4649, 314]


def cli_proc(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """The real `appliance` process (argument parsing, exit status)."""
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """The same entry point in this process: the same code without a torch import per call (CI time)."""
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = old_stdin
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("reconcile-adapters")
    for i, name in enumerate(["a", "b", "b2", "c", "d", "e", "x"]):
        make_adapter(tiny_model_dir, root / name, seed=20 + i, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return root


def test_plan_apply_status(tmp_path: Path, tiny_model_dir: Path, root: Path) -> None:
    tree = write_tree(tmp_path / "configs", tiny_model_dir, root, {
        "team_a": {"a": {"path": root / "a"}, "b": {"path": root / "b"}},
        "team_b": {"c": {"path": root / "c"}},
    })
    cfg = compose_config(tree, ["server.port=0"])
    srv = ServerThread(cfg, ConfigSource(tree, ("server.port=0",))).start()
    try:
        url = ["--config-dir", str(tree), "--url", srv.url]
        assert set(live(srv.url)) == {"a", "b", "c"}  # loaded at start from both files
        out = cli("plan", "--detailed-exitcode", *url)
        assert out.returncode == 0 and "No changes" in out.stdout, out.stdout + out.stderr

        # The operator's edit: pin a, point b at other weights, drop c, add d.
        write_inventory(tree / "adapters" / "team_a.yaml",
                        {"a": {"path": root / "a", "pinned": True}, "b": {"path": root / "b2"}})
        write_inventory(tree / "adapters" / "team_b.yaml", {"d": {"path": root / "d"}})
        before = live(srv.url)
        out = cli_proc("plan", "--detailed-exitcode", *url)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stdout.splitlines() == [
            "- c: unload (not in the config)",
            f"-/+ b: reload (path changed: {root / 'b'} -> {root / 'b2'})",
            f"+ d: load (not loaded ({root / 'd'}))",
            "~ a: pin (pinned: False -> True)",
            "Plan: 1 to load, 1 to reload, 1 to unload, 1 to pin/unpin.",
        ]
        assert live(srv.url) == before  # plan is read-only

        # Without --auto-approve, anything but "yes" cancels and changes nothing.
        out = cli("apply", *url, stdin="no\n")
        assert out.returncode == 1 and "cancelled" in out.stderr and live(srv.url) == before
        out = cli("apply", "--dry-run", *url)
        assert out.returncode == 0 and "Dry run" in out.stdout and live(srv.url) == before

        out = cli_proc("apply", "--auto-approve", *url)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Apply complete: 4 done, 0 failed." in out.stdout
        now = live(srv.url)
        assert set(now) == {"a", "b", "d"} and now["a"]["pinned"] and now["a"]["tier"] == "gpu"
        assert now["b"]["path"] == str(root / "b2")
        out = cli("plan", "--detailed-exitcode", *url)
        assert out.returncode == 0 and "No changes" in out.stdout, out.stdout
        out = cli("apply", "--auto-approve", *url)  # idempotent
        assert out.returncode == 0 and "No changes" in out.stdout

        # The new and the reloaded adapters answer exactly as peft does with the same files.
        for name, d in (("d", root / "d"), ("b", root / "b2")):
            r = requests.post(srv.url + "/v1/completions", json={
                "model": name, "prompt": PROMPT_IDS, "max_tokens": NEW, "temperature": 0, "ignore_eos": True},
                timeout=60)
            assert r.status_code == 200, r.text
            expected = peft_greedy(tiny_model_dir, d, [PROMPT_IDS])[0][0]
            got = srv.engine.tokenizer.encode(r.json()["choices"][0]["text"], add_special_tokens=False)
            assert got == expected, name

        # status: generation, conditions and the adapter table.
        out = cli("status", *url)
        assert out.returncode == 0, out.stderr
        assert "config: generation 1" in out.stdout and "ConfigValid: True" in out.stdout
        # the settings with auto resolved at start (engine/runtime.py), as the engine runs them
        assert "runtime: device=cpu, dtype=float32" in out.stdout and "lora.backend=torch" in out.stdout, out.stdout
        table = [line.split()[:4] for line in out.stdout.splitlines()]
        assert ["a", "gpu", "0", "yes"] in table or any(r[:2] == ["a", "gpu"] and r[3] == "yes" for r in table)
        assert {r[0] for r in table} >= {"NAME", "a", "b", "d"}

        # A failed action: drift "x" pinned through the API and kept (--no-prune) takes the last pin,
        # so pinning b fails; loading e still happens, the command exits 1 and says which failed.
        assert admin(srv.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "x"),
                                                     "pinned": True}).status_code == 200
        write_inventory(tree / "adapters" / "team_a.yaml",
                        {"a": {"path": root / "a", "pinned": True}, "b": {"path": root / "b2", "pinned": True}})
        write_inventory(tree / "adapters" / "team_b.yaml", {"d": {"path": root / "d"}, "e": {"path": root / "e"}})
        out = cli("apply", "--auto-approve", "--no-prune", *url)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "= x: kept (live but not in the config; pruning is off)" in out.stdout
        assert "+ e: load done" in out.stdout
        assert "~ b: pin FAILED: /v1/pin_lora_adapter answered 400: cannot pin 'b@" in out.stdout
        assert "at most 2 of 3 GPU slots" in out.stdout
        assert "1 done, 1 failed" in out.stdout
        now = live(srv.url)
        assert set(now) == {"a", "b", "d", "e", "x"} and not now["b"]["pinned"]

        # Engine-level settings: reported as requiring a restart, never applied.
        cfg_text = (tree / "config.yaml").read_text()
        (tree / "config.yaml").write_text(cfg_text.replace("max_lora_rank: 8", "max_lora_rank: 16"))
        write_inventory(tree / "adapters" / "team_a.yaml", {"a": {"path": root / "a", "pinned": True},
                                                            "b": {"path": root / "b2"}})
        # x came through the admin API: the default (prune owned) keeps it; --prune all unloads it.
        out = cli("plan", "--detailed-exitcode", *url)
        assert "= x: unmanaged (loaded through the admin API; kept, reconcile.prune is owned)" in out.stdout
        out = cli("plan", "--detailed-exitcode", "--prune", "all", *url)
        assert out.returncode == 2
        assert out.stdout.splitlines() == ["- x: unload (not in the config)",
                                           "! lora.max_lora_rank: 8 -> 16 (requires restart)",
                                           "Plan: 0 to load, 0 to reload, 1 to unload, 0 to pin/unpin. "
                                           "1 setting(s) need a restart (not applied live)."]
        out = cli("apply", "--auto-approve", "--prune", "all", *url)
        assert out.returncode == 0 and "Restart the server" in out.stdout, out.stdout
        assert set(live(srv.url)) == {"a", "b", "d", "e"}
        status = admin(srv.url, "/v1/status").json()
        assert status["settings"]["lora.max_lora_rank"] == 8
        out = cli("plan", "--detailed-exitcode", *url)
        assert out.returncode == 2 and out.stdout.splitlines()[0].startswith("! lora.max_lora_rank")
    finally:
        srv.stop()


def test_apply_usage_and_server_errors_exit_1(tmp_path: Path, tiny_model_dir: Path, root: Path) -> None:
    tree = write_tree(tmp_path / "configs", tiny_model_dir, root, {"team_a": {"a": {"path": root / "a"}}})
    assert cli_proc("apply", "--bogus", "--config-dir", str(tree)).returncode == 1  # never 2
    down = cli("apply", "--auto-approve", "--config-dir", str(tree), "--url", "http://127.0.0.1:9")
    assert down.returncode == 1 and "cannot reach" in down.stderr
