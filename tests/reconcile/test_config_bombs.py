"""Issue 29, config half: hostile YAML in the config dir, and a watcher that outlives its dir.

- YAML bombs (an alias bomb, a huge list, a huge comment) are refused before composition with a
  ConfigError naming the file (config/file_limits.py), by `compose` and by a live server's hot reload,
  which keeps serving its previous adapters; a file saved between the check and the compose cannot
  slip past it (Hydra composes the bytes that were checked);
- the reconciler composes outside the admin lock, so the admin API answers while a config is parsed;
- the watcher survives its config dir being deleted and restored (reconcile/watch.py).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from appliance.config.compose import compose_config, compose_tree
from appliance.config.file_limits import MAX_FILE_BYTES, MAX_NODES
from appliance.config.schema import ConfigError
from appliance.reconcile.controller import ConfigSource, Reconciler
from tests.conftest import config_tree
from tests.lora.test_lora_engine import make_adapter
from tests.reconcile.trees import admin, live, rename_save, wait_for, write_tree
from tests.server.conftest import ServerThread

# 306 bytes in the issue; nine levels of nine aliases: 9**9 (387 million) nodes once expanded.
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi"))


def bombs(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (file text, what the error says). Written lazily: the comment is 50 MiB."""
    return {
        "alias bomb": (ALIAS_BOMB, f"more than {MAX_NODES} YAML nodes"),
        "long list": ("big:\n" + "  - 1\n" * (MAX_FILE_BYTES // 7), f"more than {MAX_NODES} YAML nodes"),
        "huge comment": ("#" + "c" * (50 * 1024 * 1024) + "\n", f"a config file may hold at most {MAX_FILE_BYTES}"),
    }


@pytest.mark.parametrize("case", ["alias bomb", "long list", "huge comment"])
def test_yaml_bombs_are_refused_before_composition(tmp_path: Path, case: str) -> None:
    tree = config_tree(tmp_path / "configs", "")
    text, needle = bombs(tmp_path)[case]
    bomb = tree / "adapters" / "bomb.yaml"
    bomb.write_text(text)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        compose_config(tree, ["adapters=[bomb]"])
    took = time.monotonic() - t0
    assert str(e.value).startswith(f"{bomb}: ") and needle in str(e.value), str(e.value)[:300]
    assert took < 30, took  # minutes before the limits (111 s for the alias bomb on this machine)


# Just over MAX_NODES once its aliases are expanded (27,000 nodes), yet quick to compose if it got through.
SMALL_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x]\n" + \
    "b: &b [" + ", ".join(["*a"] * 30) + "]\n" + "c: [" + ", ".join(["*b"] * 30) + "]\n"


def test_a_file_saved_after_the_check_is_not_what_gets_composed(tmp_path: Path) -> None:
    """The soak found it: the limits read each file, then Hydra read it again, so a rename-save in
    between put an unchecked bomb into the compose (a hot reload spent minutes expanding one). Here
    the inventory is swapped for a bomb before any later open of it, as a save at that moment would:
    the compose must give the checked content, or refuse."""
    tree = config_tree(tmp_path / "configs", "lora:\n  enabled: true\n")
    inv = tree / "adapters" / "team.yaml"
    inv.write_text("a1:\n  path: /srv/a1\n")
    want = compose_tree(tree, ["adapters=[team]"]).cfg.adapters
    opens: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and str(args[0]) == str(inv):
            opens.append(str(args[0]))
            if len(opens) == 2:  # the check has read it; whatever opens it again sees the bomb
                rename_save(inv, SMALL_BOMB)

    _audit(hook)
    try:
        cfg = compose_tree(tree, ["adapters=[team]"]).cfg
        assert cfg.adapters == want
    except ConfigError as e:
        assert f"more than {MAX_NODES} YAML nodes" in str(e), str(e)[:300]
    finally:
        _audit(None)
    assert len(opens) >= 1


def test_symlinked_dirs_are_composed_and_checked(tmp_path: Path) -> None:
    """A group dir mounted through a symlink (as Kubernetes ConfigMaps do) composes from the snapshot,
    and a bomb in it is refused (the old check walked past symlinked dirs)."""
    tree = config_tree(tmp_path / "configs", "lora:\n  enabled: true\n")
    real = tmp_path / "mounted"
    shutil.move(tree / "adapters", real)
    (tree / "adapters").symlink_to(real)
    (real / "team.yaml").write_text("a1:\n  path: /srv/a1\n")
    assert sorted(compose_tree(tree, ["adapters=[team]"]).cfg.adapters) == ["a1"]
    (real / "loop").symlink_to(real)  # a loop ends
    (real / "team.yaml").write_text(SMALL_BOMB)
    with pytest.raises(ConfigError, match=f"more than {MAX_NODES} YAML nodes"):
        compose_tree(tree, ["adapters=[team]"])


def _audit(hook: Any) -> None:
    """One process-wide audit hook (they cannot be removed) that forwards to `hook` while it is set."""
    import sys

    if not getattr(sys, "_appliance_config_hook", None):
        sys.addaudithook(lambda e, a: sys._appliance_config_hook(e, a))  # type: ignore[attr-defined]
    sys._appliance_config_hook = hook or (lambda e, a: None)  # type: ignore[attr-defined]


def test_a_tree_under_the_limits_composes(tmp_path: Path) -> None:
    """Anchors and aliases themselves are fine: the limit counts what they expand to."""
    tree = config_tree(tmp_path / "configs", "")
    (tree / "adapters" / "team.yaml").write_text(
        "base: &common {path: /srv/a, rank: 8}\nother: *common\n")
    assert sorted(compose_tree(tree, ["adapters=[team]", "lora.enabled=true"]).cfg.adapters) == ["base", "other"]


class _Ops:
    """Just enough of AdapterAdmin for a reconcile whose config is invalid (no adapter is touched)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()

    async def snapshot(self) -> dict[str, Any]:
        raise AssertionError("an invalid config is never planned")


def test_the_admin_lock_is_free_while_a_config_is_composed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import appliance.config.validate as validate

    tree = config_tree(tmp_path / "configs", "")
    entered, release = threading.Event(), threading.Event()

    def slow_validate(config_dir: Any, overrides: Any, layered: Any = None) -> tuple[None, list[str]]:
        entered.set()
        assert release.wait(30)
        return None, ["config/x.yaml: refused"]

    async def scenario() -> None:
        ops = _Ops()
        rec = Reconciler(compose_config(tree), ops, ConfigSource(tree))
        monkeypatch.setattr(validate, "validate_tree", slow_validate)
        task = asyncio.create_task(rec.reconcile("watch"))
        await asyncio.to_thread(entered.wait, 30)
        # An admin call during the compose gets the lock at once.
        await asyncio.wait_for(ops.lock.acquire(), 1)
        ops.lock.release()
        release.set()
        record = await task
        assert record.result == "invalid" and record.problems == ["config/x.yaml: refused"]
        assert not ops.lock.locked()

    asyncio.run(scenario())


@pytest.fixture()
def served_tree(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[ServerThread, Path, Path]]:
    root = tmp_path / "adapters-root"
    for i, name in enumerate(["keep", "b"]):
        make_adapter(tiny_model_dir, root / name, seed=3 + i, r=4, lora_alpha=8, target_modules=["q_proj"])
    tree = write_tree(tmp_path / "configs", tiny_model_dir, root, {"team": {"keep": {"path": root / "keep"}}},
                      watch=True)
    srv = ServerThread(compose_config(tree, ["server.port=0"]), ConfigSource(tree, ("server.port=0",))).start()
    try:
        yield srv, tree, root
    finally:
        srv.stop()


def _condition(url: str, type_: str) -> dict:
    return next(c for c in admin(url, "/v1/status").json()["conditions"] if c["type"] == type_)


def test_a_bomb_saved_into_a_live_config_dir_is_refused(served_tree: tuple[ServerThread, Path, Path]) -> None:
    srv, tree, _ = served_tree
    inv = tree / "adapters" / "team.yaml"
    rename_save(inv, ALIAS_BOMB)
    wait_for(lambda: _condition(srv.url, "ConfigValid")["status"] == "False", 30)
    c = _condition(srv.url, "ConfigValid")
    assert "team.yaml" in c["message"] and f"more than {MAX_NODES} YAML nodes" in c["message"], c
    assert set(live(srv.url)) == {"keep"}


def _watcher(url: str) -> dict:
    return admin(url, "/v1/status").json()["config"]["watcher"]


def test_the_watcher_survives_its_dir_deleted_and_restored(served_tree: tuple[ServerThread, Path, Path],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The dir is moved away (as `rm -r` then a restore from backup, or a volume remount, would):
    the watcher says so in /v1/status and the log, re-arms when it is back, reconciles what the
    restored dir holds, and goes on seeing edits."""
    import logging

    from tests.reconcile.trees import inventory_yaml

    srv, tree, root = served_tree
    caplog.set_level(logging.INFO, logger="appliance.reconcile.watch")
    wait_for(lambda: _watcher(srv.url)["state"] == "watching", 30)
    backup = tree.with_name("backup")
    shutil.copytree(tree, backup)
    shutil.rmtree(tree)
    wait_for(lambda: _watcher(srv.url)["state"] == "waiting", 30)
    assert "does not exist" in _watcher(srv.url)["message"]
    (backup / "adapters" / "team.yaml").write_text(
        inventory_yaml({"keep": {"path": root / "keep"}, "b": {"path": root / "b"}}))
    shutil.copytree(backup, tree)  # restored, with one adapter more
    wait_for(lambda: set(live(srv.url)) == {"keep", "b"}, 30)
    assert _watcher(srv.url)["state"] == "watching"
    # Re-armed on the new directory: a later edit is seen.
    (tree / "adapters" / "team.yaml").write_text(inventory_yaml({"b": {"path": root / "b"}}))
    wait_for(lambda: set(live(srv.url)) == {"b"}, 30)
    assert "is gone" in caplog.text and "is back: watching it again" in caplog.text
