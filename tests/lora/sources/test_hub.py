"""hf:// adapters through huggingface_hub's real code path, offline (HF_HUB_OFFLINE=1, read by
huggingface_hub at import: so in a fresh process) against a hub cache laid out as huggingface_hub
writes it (blobs, snapshots of links, refs): branches, tags and commits resolve to their snapshot,
a missing revision or repo is a clean error, and the fetched dir passes the adapter reader."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lora.test_lora_engine import ADAPTERS, make_adapter

REPO_ROOT = Path(__file__).resolve().parents[3]
C1, C2 = "1" * 40, "2" * 40  # commits: main has the adapter at the top, v1 (a tag) in sub/

FETCH = """
import json, sys
from appliance.config.schema import LoRAConfig
from appliance.lora.sources.fetch import AdapterSources
from appliance.lora.sources.uri import SourceError
cfg = LoRAConfig(allowed_sources=["hf://acme"], adapter_cache_dir=sys.argv[1], hub_cache_dir=sys.argv[2])
src = AdapterSources(cfg)
out = {}
for uri in sys.argv[3:]:
    try:
        f = src.fetch(uri)
        out[uri] = {"dir": str(f.dir), "revision": f.revision, "source": f.source}
    except SourceError as e:
        out[uri] = {"error": str(e)}
print(json.dumps(out))
"""


def put(hub: Path, repo: str, commit: str, files: dict[str, bytes], refs: list[str]) -> None:
    """One commit of `repo` in huggingface_hub's cache layout."""
    base = hub / f"models--{repo.replace('/', '--')}"
    for rel, data in files.items():
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = base / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(commit)


def fetch(cache: Path, hub: Path, *uris: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, "-c", FETCH, str(cache), str(hub), *uris], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-adapters")
    return {n: make_adapter(tiny_model_dir, root / n, seed=30 + i, **ADAPTERS[n]) for i, n in enumerate(("qv4", "mlp6"))}


def files_of(d: Path, sub: str = "") -> dict[str, bytes]:
    return {f"{sub}{f.name}": f.read_bytes() for f in d.iterdir() if f.name.startswith("adapter_")}


def test_hub_offline_revisions(tmp_path: Path, adapters: dict[str, Path], tiny_model_dir: Path) -> None:
    from appliance.config.schema import LoRAConfig
    from appliance.lora.adapter import inspect_adapter
    from appliance.models.args import ModelArgs, read_hf_config

    hub = tmp_path / "hub"
    put(hub, "acme/loras", C1, files_of(adapters["qv4"]), ["main"])
    put(hub, "acme/loras", C2, files_of(adapters["mlp6"], "sub/"), ["v1"])
    cache = tmp_path / "cache"
    got = fetch(cache, hub, "hf://acme/loras", "hf://acme/loras@v1/sub", f"hf://acme/loras@{C2}/sub",
                "hf://acme/loras@v2", "hf://acme/missing", "hf://acme/loras@v1", "hf://other/loras")
    main, tag, commit = got["hf://acme/loras"], got["hf://acme/loras@v1/sub"], got[f"hf://acme/loras@{C2}/sub"]
    assert main["revision"] == f"commit:{C1}" and tag["revision"] == commit["revision"] == f"commit:{C2}"
    for entry, name in ((main, "qv4"), (tag, "mlp6"), (commit, "mlp6")):
        d = Path(entry["dir"])
        assert d.parent == cache and not any(p.is_symlink() for p in d.iterdir())  # copies, not links
        assert files_of(d) == files_of(adapters[name])
    cfg = LoRAConfig(max_lora_rank=8, allowed_sources=["hf://acme"], adapter_cache_dir=str(cache))
    args = ModelArgs.from_hf_config(read_hf_config(tiny_model_dir))
    assert inspect_adapter(main["dir"], cfg, args).rank == 4  # the fetched dir passes the confined reader
    assert inspect_adapter(tag["dir"], cfg, args).rank == 6
    assert "not in the local Hugging Face cache" in got["hf://acme/loras@v2"]["error"]
    assert "not in the local Hugging Face cache" in got["hf://acme/missing"]["error"]
    assert "no adapter_config.json at revision " + C2 in got["hf://acme/loras@v1"]["error"]  # it lives in sub/
    assert "not under lora.allowed_sources" in got["hf://other/loras"]["error"]
