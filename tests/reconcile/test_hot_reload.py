"""Hot reload in `appliance serve`: the server watches its config dir and converges to it.

A real server on the tiny model with peft-made adapters; a client loop runs the whole time and checks
every answer against peft's greedy tokens for its adapter. The dir is changed the ways it changes in
practice: an in-place write, an editor's rename-save, invalid files (bad YAML, unknown key, wrong type)
which must leave the previous adapters serving, an engine-level edit which must not be applied, and
Kubernetes ConfigMap updates (top-level symlinks through a `..data` symlink that is swapped).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import pytest
import requests

from appliance.config.compose import compose_config
from appliance.reconcile.controller import ConfigSource
from tests.lora.test_lora_engine import NEW, make_adapter, peft_greedy
from tests.reconcile.trees import admin, inventory_yaml, live, rename_save, wait_for, write_inventory, write_tree
from tests.server.conftest import ServerThread

PROMPT_IDS = [1, 504, 3458, 282, 4649, 314]
CONVERGE_S = 10.0


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("hot-adapters")
    for i, name in enumerate(["keep", "b", "c"]):
        make_adapter(tiny_model_dir, root / name, seed=40 + i, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return root


@pytest.fixture(scope="module")
def oracle(tiny_model_dir: Path, root: Path) -> dict[Optional[str], list[int]]:
    return {None: peft_greedy(tiny_model_dir, None, [PROMPT_IDS])[0][0],
            "keep": peft_greedy(tiny_model_dir, root / "keep", [PROMPT_IDS])[0][0]}


class Traffic:
    """Requests for the base model and the adapter every config keeps, back to back, in a thread."""

    def __init__(self, srv: ServerThread, oracle: dict[Optional[str], list[int]]) -> None:
        self.srv, self.oracle = srv, oracle
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        tok = self.srv.engine.tokenizer
        i = 0
        while not self._stop.is_set():
            model = ["tiny", "keep"][i % 2]
            i += 1
            try:
                r = requests.post(self.srv.url + "/v1/completions", timeout=60, json={
                    "model": model, "prompt": PROMPT_IDS, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
            except requests.RequestException as e:
                self.failures.append(f"{model}: {e}")
                continue
            if r.status_code != 200:
                self.failures.append(f"{model}: {r.status_code} {r.text[:200]}")
                continue
            got = tok.encode(r.json()["choices"][0]["text"], add_special_tokens=False)
            if got != self.oracle[None if model == "tiny" else model]:
                self.failures.append(f"{model}: wrong output {got}")
            else:
                self.ok += 1


def scrape(url: str) -> dict[str, float]:
    """GET /metrics as series -> value (comments skipped)."""
    out = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def status(url: str) -> dict:
    return admin(url, "/v1/status").json()


def condition(url: str, type_: str) -> dict:
    return next(c for c in status(url)["conditions"] if c["type"] == type_)


def names_are(url: str, *names: str):
    return lambda: set(live(url)) == set(names)


def test_watch_plain_dir(tmp_path: Path, tiny_model_dir: Path, root: Path, oracle: dict) -> None:
    tree = write_tree(tmp_path / "configs", tiny_model_dir, root, {"team": {"keep": {"path": root / "keep"}}},
                      watch=True)
    inv = tree / "adapters" / "team.yaml"
    srv = ServerThread(compose_config(tree, ["server.port=0"]), ConfigSource(tree, ("server.port=0",))).start()
    took: dict[str, float] = {}
    try:
        with Traffic(srv, oracle) as traffic:
            # 1. In-place write (same inode): b added.
            with open(inv, "w") as f:
                f.write(inventory_yaml({"keep": {"path": root / "keep"}, "b": {"path": root / "b"}}))
            took["in-place"] = wait_for(names_are(srv.url, "keep", "b"), CONVERGE_S)
            assert status(srv.url)["config"]["generation"] == 2

            # 2. Rename-save: b out, c in and pinned.
            rename_save(inv, inventory_yaml({"keep": {"path": root / "keep"}, "c": {"path": root / "c", "pinned": True}}))
            took["rename-save"] = wait_for(
                lambda: set(live(srv.url)) == {"keep", "c"} and live(srv.url)["c"]["pinned"], CONVERGE_S)
            assert condition(srv.url, "Reconciled")["status"] == "True"

            # 3. Invalid files: each leaves the previous adapters serving and is reported with its key.
            good = inv.read_text()
            for bad, needle in [("keep: [unclosed\n", "team"),
                                (good + "  colour: blue\n", "colour"),
                                (good.replace("pinned: true", "pinned: maybe"), "pinned")]:
                gen = status(srv.url)["config"]["generation"]
                rename_save(inv, bad)
                wait_for(lambda: condition(srv.url, "ConfigValid")["status"] == "False", CONVERGE_S)
                c = condition(srv.url, "ConfigValid")
                assert c["reason"] == "Invalid" and needle in c["message"], c
                assert set(live(srv.url)) == {"keep", "c"} and status(srv.url)["config"]["generation"] == gen
                v = subprocess.run([sys.executable, "-m", "appliance", "validate", "--config-dir", str(tree)],
                                   capture_output=True, text=True, timeout=300)
                assert v.returncode == 1 and needle in v.stderr, v.stderr
                rename_save(inv, good)
                wait_for(lambda: condition(srv.url, "ConfigValid")["status"] == "True", CONVERGE_S)

            # 4. Engine-level edit (with an adapter change): the adapters follow, the rank does not.
            cfg_text = (tree / "config.yaml").read_text()
            (tree / "config.yaml").write_text(cfg_text.replace("max_lora_rank: 8", "max_lora_rank: 16"))
            write_inventory(inv, {"keep": {"path": root / "keep"}})
            wait_for(lambda: condition(srv.url, "Reconciled")["reason"] == "RestartRequired"
                     and set(live(srv.url)) == {"keep"}, CONVERGE_S)
            st = status(srv.url)
            assert st["restart_required"] == ["lora.max_lora_rank: 8 -> 16 (requires restart)"]
            assert st["settings"]["lora.max_lora_rank"] == 8
            assert srv.engine.engine.lora.cfg.max_lora_rank == 8

            # The reconcile metrics follow what happened (counted per reconcile, so at least).
            m = scrape(srv.url)
            assert m['appliance_config_generation'] == st["config"]["generation"]
            assert m['appliance_config_last_reload_successful'] == 1
            assert m['appliance_reconcile_total{result="invalid"}'] >= 3
            assert m['appliance_reconcile_actions_total{action="load",result="success"}'] >= 2  # b, then c
            assert m['appliance_reconcile_actions_total{action="unload",result="success"}'] >= 2
            assert m['appliance_reconcile_duration_seconds_count'] == sum(
                v for k, v in m.items() if k.startswith("appliance_reconcile_total{"))
        assert traffic.failures == [] and traffic.ok > 0, traffic.failures[:5]
        print(f"\nhot reload convergence (s): {took}; client requests ok: {traffic.ok}, failed: 0")
    finally:
        srv.stop()


def _configmap_dir(dest: Path, tree: Path, stamp: str) -> None:
    """Kubernetes' atomic writer: the payload in ..<stamp>/, `..data` -> it, top-level symlinks."""
    shutil.copytree(tree, dest / f"..{stamp}")
    tmp = dest / "..data_tmp"
    tmp.symlink_to(f"..{stamp}")
    os.replace(tmp, dest / "..data")


def test_watch_configmap_swaps(tmp_path: Path, tiny_model_dir: Path, root: Path, oracle: dict) -> None:
    payload = write_tree(tmp_path / "payload", tiny_model_dir, root, {"team": {"keep": {"path": root / "keep"}}},
                         watch=True)
    mount = tmp_path / "mount"
    mount.mkdir()
    _configmap_dir(mount, payload, "2026_11_29_00")
    for entry in os.listdir(payload):
        (mount / entry).symlink_to(Path("..data") / entry)
    srv = ServerThread(compose_config(mount, ["server.port=0"]), ConfigSource(mount, ("server.port=0",))).start()
    took = []
    try:
        with Traffic(srv, oracle) as traffic:
            for i, inv in enumerate([{"keep": {"path": root / "keep"}, "b": {"path": root / "b"}},
                                     {"keep": {"path": root / "keep", "pinned": True}, "c": {"path": root / "c"}}]):
                write_inventory(payload / "adapters" / "team.yaml", inv)
                old = os.readlink(mount / "..data")
                _configmap_dir(mount, payload, f"2026_11_29_0{i + 1}")
                shutil.rmtree(mount / old)  # the kubelet removes the old payload after the swap
                took.append(wait_for(lambda: {n: a["pinned"] for n, a in live(srv.url).items()}
                                     == {n: a.get("pinned", False) for n, a in inv.items()}, CONVERGE_S))
            assert status(srv.url)["config"]["generation"] == 3
        assert traffic.failures == [] and traffic.ok > 0, traffic.failures[:5]
        print(f"\nConfigMap swaps converged in (s): {took}; client requests ok: {traffic.ok}, failed: 0")
    finally:
        srv.stop()


def test_resync_repairs_drift(tmp_path: Path, tiny_model_dir: Path, root: Path) -> None:
    """With watch off and prune all, the periodic resync still unloads an adapter loaded behind the
    config's back."""
    tree = write_tree(tmp_path / "configs", tiny_model_dir, root, {"team": {"keep": {"path": root / "keep"}}},
                      watch=False, resync_s=0.5, prune="all")
    srv = ServerThread(compose_config(tree, ["server.port=0"]), ConfigSource(tree, ("server.port=0",))).start()
    try:
        r = admin(srv.url, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(root / "b")})
        assert r.status_code == 200, r.text
        wait_for(names_are(srv.url, "keep"), CONVERGE_S)
        last = status(srv.url)["last_reconcile"]
        assert last["trigger"] == "resync" and last["result"] == "success"
    finally:
        srv.stop()


def test_resync_prunes_only_what_the_config_owns(tmp_path: Path, tiny_model_dir: Path, root: Path) -> None:
    """The default (prune owned): an adapter loaded through the admin API survives resyncs; one the
    config declared is unloaded once it leaves the file; a declared one the API loaded is adopted."""
    tree = write_tree(tmp_path / "configs", tiny_model_dir, root,
                      {"team": {"keep": {"path": root / "keep"}, "gone": {"path": root / "c"}}},
                      watch=False, resync_s=0.3)
    srv = ServerThread(compose_config(tree, ["server.port=0"]), ConfigSource(tree, ("server.port=0",))).start()
    try:
        r = admin(srv.url, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(root / "b")})
        assert r.status_code == 200 and r.json()["adapter"]["managed"] is False, r.text
        write_inventory(tree / "adapters" / "team.yaml", {"keep": {"path": root / "keep"}})
        wait_for(names_are(srv.url, "b", "keep"), CONVERGE_S)
        seen = status(srv.url)["last_reconcile"]["at"]
        wait_for(lambda: status(srv.url)["last_reconcile"]["at"] != seen, CONVERGE_S)  # one more resync
        body = admin(srv.url, "/v1/adapters").json()
        assert {d["name"]: d["managed"] for d in body["data"]} == {"b": False, "keep": True}
        # Declared now with the same files: adopted (no reload), so it goes once the file drops it.
        write_inventory(tree / "adapters" / "team.yaml", {"keep": {"path": root / "keep"}, "b": {"path": root / "b"}})
        wait_for(lambda: live(srv.url)["b"].get("managed") is True, CONVERGE_S)
        write_inventory(tree / "adapters" / "team.yaml", {"keep": {"path": root / "keep"}})
        wait_for(names_are(srv.url, "keep"), CONVERGE_S)
    finally:
        srv.stop()
