"""`appliance plan` against a live server (real engine, real uvicorn, real peft adapters)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import requests

from tests.conftest import config_tree, default_config
from tests.lora.test_lora_engine import make_adapter
from tests.server.conftest import ServerThread

KEY = "plan-secret"


def write_tree(dest: Path, model: Path, root: Path, adapters_yaml: str) -> Path:
    return config_tree(dest, f"model:\n  path: {model}\nserver:\n  admin_key: {KEY}\nlora:\n  enabled: true\n"
                             f"  max_lora_rank: 8\n  adapter_roots: [{root}]\nadapters:\n{adapters_yaml}")


def test_plan_against_live_server(tmp_path: Path, tiny_model_dir: Path) -> None:
    root = tmp_path / "adapters"
    for i, name in enumerate(["a", "b", "b2", "c"]):
        make_adapter(tiny_model_dir, root / name, seed=i, r=4, lora_alpha=8, target_modules=["q_proj"])
    cfg = default_config(f"model.path={tiny_model_dir}", "server.port=0", f"server.admin_key={KEY}",
                         "lora.enabled=true", "lora.max_lora_rank=8", f"lora.adapter_roots=[{root}]")
    srv = ServerThread(cfg).start()
    try:
        for name, path in [("a", root / "a"), ("b", root / "b"), ("c", root / "c")]:
            r = requests.post(srv.url + "/load_lora_adapter", headers={"Authorization": f"Bearer {KEY}"},
                              json={"lora_name": name, "lora_path": str(path)}, timeout=60)
            assert r.status_code == 200, r.text
        # The adapters came through the admin API: --prune all diffs them as if the config owned them.
        cmd = [sys.executable, "-m", "appliance", "plan", "--url", srv.url, "--detailed-exitcode", "--prune", "all",
               "--config-dir"]
        # Wanted: a pinned, b with other weights (b2's files copied over b's path), d new, c gone.
        shutil.copytree(root / "b2", root / "b_new")
        changed = write_tree(tmp_path / "changed", tiny_model_dir, root,
                             f"  a:\n    path: {root / 'a'}\n    pinned: true\n"
                             f"  b:\n    path: {root / 'b_new'}\n"
                             f"  d:\n    path: {root / 'b2'}\n")
        out = subprocess.run(cmd + [str(changed)], capture_output=True, text=True)
        assert out.returncode == 2, out.stderr
        lines = out.stdout.strip().splitlines()
        assert lines == [
            "- c: unload (not in the config)",
            f"-/+ b: reload (path changed: {root / 'b'} -> {root / 'b_new'})",
            f"+ d: load (not loaded ({root / 'b2'}))",
            "~ a: pin (pinned: False -> True)",
            "Plan: 1 to load, 1 to reload, 1 to unload, 1 to pin/unpin.",
        ]
        # Same path, new bytes: a weights change is found by checksum.
        shutil.copy(root / "b2" / "adapter_model.safetensors", root / "c" / "adapter_model.safetensors")
        same = write_tree(tmp_path / "same", tiny_model_dir, root,
                          f"  a:\n    path: {root / 'a'}\n  b:\n    path: {root / 'b'}\n  c:\n    path: {root / 'c'}\n")
        out = subprocess.run(cmd + [str(same)], capture_output=True, text=True)
        assert out.returncode == 2 and out.stdout.startswith("-/+ c: reload (weights changed: checksum"), out.stdout
        shutil.copy(root / "b2" / "adapter_model.safetensors", root / "c" / "adapter_model.safetensors")
        requests.post(srv.url + "/load_lora_adapter", headers={"Authorization": f"Bearer {KEY}"},
                      json={"lora_name": "c", "lora_path": str(root / "c"), "load_inplace": True}, timeout=60)
        out = subprocess.run(cmd + [str(same)], capture_output=True, text=True)
        assert out.returncode == 0 and "No changes" in out.stdout, out.stdout + out.stderr
        # A wrong admin key is an error (1), never "changes" (2).
        bad_key = subprocess.run(cmd + [str(same), "server.admin_key=wrong"], capture_output=True, text=True)
        assert bad_key.returncode == 1 and "401" in bad_key.stderr
    finally:
        srv.stop()
