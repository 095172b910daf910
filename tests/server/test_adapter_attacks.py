"""Hostile adapters through the admin API of a live server (tiny model, adapters written by peft, then
damaged): each load is refused with 400 in the OpenAI error shape (code invalid_adapter), nothing
changes (registry, pins), and the server goes on answering base and adapter requests exactly.
Also: a load's files are read and checked off the engine thread. The loader's own tests, attack by
attack: tests/lora/test_adapter_hardening.py.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests
from safetensors.torch import load_file, save_file

from tests.lora.test_adapter_hardening import on_first_open, wrong_shape_copy  # noqa: F401 - fixture
from tests.lora.test_lora_engine import make_adapter, peft_greedy
from tests.server.conftest import ServerThread, start_server
from tests.server.test_faults import GREEDY, PROMPT

ADMIN = {"Authorization": "Bearer attacks"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("attack-adapters")
    for i, name in enumerate(["good", "template"]):
        make_adapter(tiny_model_dir, root / name, seed=90 + i, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return root


@pytest.fixture(scope="module")
def oracle(tiny_model_dir: Path, root: Path) -> dict:
    return {None: peft_greedy(tiny_model_dir, None, [PROMPT])[0][0],
            "good": peft_greedy(tiny_model_dir, root / "good", [PROMPT])[0][0]}


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, root: Path) -> Iterator[ServerThread]:
    s = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=512",
                     "model.device=cpu", "model.dtype=float32", "engine.num_kv_blocks=128", "lora.enabled=true",
                     "lora.max_lora_rank=8", "lora.max_loras_per_batch=3", f"lora.adapter_roots=[{root}]",
                     "server.admin_key=attacks")
    r = requests.post(s.url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                      json={"lora_name": "good", "lora_path": str(root / "good"), "pinned": True})
    assert r.status_code == 200, r.text
    yield s
    s.stop()


def load(srv: ServerThread, name: str, path: Path, pinned: bool = False) -> requests.Response:
    return requests.post(srv.url + "/load_lora_adapter", headers=ADMIN, timeout=120,
                         json={"lora_name": name, "lora_path": str(path), "pinned": pinned})


def live(srv: ServerThread) -> dict:
    body = requests.get(srv.url + "/v1/adapters", headers=ADMIN, timeout=30).json()
    return {"adapters": {a["name"]: (a["checksum"], a["pinned"], a["slot"]) for a in body["data"]},
            "pinned": body["pool"]["pinned"]}


def assert_serving(srv: ServerThread, oracle: dict) -> None:
    """Base and the pinned adapter answer exactly as peft does, and the engine is healthy and idle."""
    for model, want in (("tiny", oracle[None]), ("good", oracle["good"])):
        r = requests.post(srv.url + "/v1/completions", timeout=120, json={"model": model, "prompt": PROMPT, **GREEDY})
        assert r.status_code == 200, r.text
        assert srv.engine.tokenizer.encode(r.json()["choices"][0]["text"], add_special_tokens=False) == want
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    assert srv.wait_idle()


def _tensors(d: Path, fn: Callable[[str, object], object]) -> None:
    f = d / "adapter_model.safetensors"
    save_file({k: fn(k, v) for k, v in load_file(f).items()}, f)


def _config(d: Path, **changes: object) -> None:
    p = d / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def _nested(d: Path) -> None:
    p = d / "adapter_config.json"
    p.write_text(p.read_text()[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _sparse_config(d: Path) -> None:
    with open(d / "adapter_config.json", "r+b") as f:
        f.truncate(2 << 30)


def _trailing_bytes(d: Path) -> None:
    f = d / "adapter_model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size + (1 << 30))


ATTACKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "nan_weights": (lambda d: _tensors(d, lambda k, v: v.fill_(float("nan")) if ".lora_B." in k else v),
                    "holds NaN or Inf values"),
    "inf_weights": (lambda d: _tensors(d, lambda k, v: v.fill_(float("inf")) if ".lora_A." in k else v),
                    "holds NaN or Inf values"),
    "alpha_overflows_fp32": (lambda d: _config(d, lora_alpha=1e40), "overflows torch.float32"),
    "deeply_nested_config": (_nested, "nested deeper than 32 levels"),
    "sparse_2gib_config": (_sparse_config, "more than the 1048576"),
    "bytes_past_the_tensors": (_trailing_bytes, "its header declares"),
    "10000_rank_pattern_keys": (lambda d: _config(d, rank_pattern={f"layers.{i}.q_proj": 4 for i in range(10_000)}),
                                "more than the 1024 allowed"),
    "backtracking_pattern_key": (lambda d: _config(d, alpha_pattern={"(.*a)+_proj": 4}), "a repeat inside a repeat"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_hostile_adapter_is_refused_and_changes_nothing(attack: str, srv: ServerThread, root: Path, oracle: dict) -> None:
    damage, needle = ATTACKS[attack]
    d = Path(shutil.copytree(root / "template", root / f"t-{attack}"))
    damage(d)
    before = live(srv)
    for pinned in (False, True):
        r = load(srv, "hostile", d, pinned=pinned)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_adapter"
        assert needle in err["message"], err["message"]
        assert live(srv) == before
    assert_serving(srv, oracle)


def test_weights_swapped_during_a_pinned_load(srv: ServerThread, root: Path, oracle: dict, tmp_path: Path,
                                              on_first_open) -> None:  # noqa: F811 - the fixture
    """Before: the header was checked on the good file, the checksum and tensors read from the swapped
    one; the pinned slot's fill raised RuntimeError: 500, and the slot stayed pinned to nothing."""
    d = Path(shutil.copytree(root / "template", root / "swapped"))
    bad = wrong_shape_copy(d, tmp_path / "bad.safetensors")
    before = live(srv)
    on_first_open(lambda p: p.endswith("adapter_model.safetensors"),
                  lambda: os.replace(bad, d / "adapter_model.safetensors"))
    r = load(srv, "swapped", d, pinned=True)
    assert r.status_code == 400 and "do not fit this base model" in r.json()["error"]["message"], r.text
    assert live(srv) == before
    assert_serving(srv, oracle)


def test_adapter_files_are_read_off_the_engine_thread(srv: ServerThread, root: Path, on_first_open) -> None:  # noqa: F811
    seen: list[str] = []
    on_first_open(lambda p: p.endswith("adapter_config.json"), lambda: seen.append(threading.current_thread().name))
    r = load(srv, "offthread", root / "template")
    assert r.status_code == 200, r.text
    assert seen and seen[0] != "engine-loop", seen
    assert requests.post(srv.url + "/unload_lora_adapter", headers=ADMIN, timeout=60,
                         json={"lora_name": "offthread"}).status_code == 200
