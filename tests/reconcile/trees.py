"""Config trees for the reconcile tests: the repository's tree with the tiny model, a LoRA root, and
adapter inventories in `adapters/*.yaml`, edited the ways operators and Kubernetes edit them."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import requests

from tests.conftest import REPO, unship

KEY = "reconcile-secret"


def write_tree(dest: Path, model: Path, root: Path, inventories: dict[str, dict[str, dict]],
               max_rank: int = 8, slots: int = 3, watch: bool = False, resync_s: float = 0,
               prune: str = "owned") -> Path:
    """A full config tree at `dest`: every file under `inventories` becomes adapters/<file>.yaml and
    is selected in config.yaml's defaults list (the multi-select group)."""
    shutil.copytree(REPO / "configs", dest, dirs_exist_ok=True)
    (dest / "adapters").mkdir(exist_ok=True)
    for f, inv in inventories.items():
        write_inventory(dest / "adapters" / f"{f}.yaml", inv)
    unship(dest, f"[{', '.join(inventories)}]")
    text = (dest / "config.yaml").read_text()
    text += (f"model:\n  path: {model}\n  name: tiny\nserver:\n  admin_key: {KEY}\n"
             f"lora:\n  enabled: true\n  max_lora_rank: {max_rank}\n  max_loras_per_batch: {slots}\n"
             f"  adapter_roots: [{root}]\n"
             f"reconcile:\n  watch: {str(watch).lower()}\n  debounce_s: 0.2\n  resync_s: {resync_s}\n"
             f"  prune: {prune}\n")
    (dest / "config.yaml").write_text(text)
    return dest


def inventory_yaml(inv: dict[str, dict]) -> str:
    if not inv:
        return "{}\n"
    out = []
    for name, a in inv.items():
        out.append(f"{name}:")
        out += [f"  {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in a.items()]
    return "\n".join(out) + "\n"


def write_inventory(path: Path, inv: dict[str, dict]) -> None:
    path.write_text(inventory_yaml(inv))


def rename_save(path: Path, text: str) -> None:
    """What vim (backupcopy=no), VS Code and most tools do: write a temp file, rename it over."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def admin(url: str, route: str, body: Optional[dict] = None) -> requests.Response:
    h = {"Authorization": f"Bearer {KEY}"}
    if body is None:
        return requests.get(url + route, headers=h, timeout=60)
    return requests.post(url + route, headers=h, json=body, timeout=60)


def live(url: str) -> dict[str, dict]:
    r = admin(url, "/v1/adapters")
    assert r.status_code == 200, r.text
    return {a["name"]: a for a in r.json()["data"]}


def wait_for(pred: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Seconds until pred() held; AssertionError after timeout_s."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not converged within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - t0
