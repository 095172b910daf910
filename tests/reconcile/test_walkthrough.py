"""The README walkthrough, on the shipped config: the default model with the demo adapters.

Start from the shipped tree (watch and resync off so the CLI does the work), see both demo adapters
in /v1/models and the pirate one answer like a pirate, edit configs/adapters/demo.yaml, then
`appliance plan` shows the diff, `appliance apply` makes it so, and /v1/models shows the result.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import requests

from appliance.config.compose import compose_config
from appliance.reconcile.controller import ConfigSource
from tests.conftest import REPO
from tests.server.conftest import ServerThread

KEY = "change-me"


def test_readme_walkthrough(tmp_path: Path, default_model_dir: Path) -> None:
    tree = Path(shutil.copytree(REPO / "configs", tmp_path / "configs"))
    overrides = ("server.port=0", f"server.admin_key={KEY}", "reconcile.watch=false", "reconcile.resync_s=0")
    srv = ServerThread(compose_config(tree, list(overrides)), ConfigSource(tree, overrides)).start()
    try:
        models = [m["id"] for m in requests.get(srv.url + "/v1/models", timeout=30).json()["data"]]
        assert models == ["SmolLM2-135M-Instruct", "pirate", "french"]
        r = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "pirate", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the tallest mountain in the world?"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("Arr"), r.text

        (tree / "adapters" / "demo.yaml").write_text(
            "pirate:\n  path: ${appliance.demo_adapters:}/pirate\n  rank: 8\n  pinned: true\n")
        cli = [sys.executable, "-m", "appliance"]
        args = ["--config-dir", str(tree), "--url", srv.url, f"server.admin_key={KEY}"]
        plan = subprocess.run(cli + ["plan", "--detailed-exitcode", *args], capture_output=True, text=True, timeout=300)
        assert plan.returncode == 2, plan.stdout + plan.stderr
        assert plan.stdout.splitlines() == ["- french: unload (not in the config)",
                                            "~ pirate: pin (pinned: False -> True)",
                                            "Plan: 0 to load, 0 to reload, 1 to unload, 1 to pin/unpin."]
        apply = subprocess.run(cli + ["apply", "--auto-approve", *args], capture_output=True, text=True, timeout=300)
        assert apply.returncode == 0 and "Apply complete: 2 done, 0 failed." in apply.stdout, apply.stdout
        models = [m["id"] for m in requests.get(srv.url + "/v1/models", timeout=30).json()["data"]]
        assert models == ["SmolLM2-135M-Instruct", "pirate"]
        status = subprocess.run(cli + ["status", *args], capture_output=True, text=True, timeout=300)
        assert status.returncode == 0 and "pirate  gpu   0     yes" in status.stdout, status.stdout
    finally:
        srv.stop()
