"""Security review of the admin surface, as tests.

- Keys: compared in constant time (hashed, then hmac.compare_digest over every key); never in a log
  line, an answer, a header, /v1/status (Hydra overrides of secret keys are masked) or /openapi.json,
  even when they come from the environment through ${oc.env:...}.
- Adapter paths: confined to lora.adapter_roots after resolving symlinks, the directory and the files
  in it (tests/server/test_faults.py and tests/server/test_lora_api.py cover the HTTP side).
- No pickle: no module of the appliance or its kernels can deserialize pickle (static scan).
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path
from typing import Iterator

import pytest
import requests

from appliance.config.compose import compose_config
from appliance.config.restart import mask_override
from appliance.reconcile.controller import ConfigSource
from appliance.server.auth import keys_match
from tests.conftest import REPO
from tests.lora.test_lora_engine import make_adapter
from tests.server.conftest import ServerThread

ADMIN_SECRET = "adm-5ecret-from-env-7c1f"
API_SECRET = "api-5ecret-from-env-91b2"


@pytest.fixture(scope="module")
def env_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[ServerThread, Path]]:
    root = tmp_path_factory.mktemp("sec-adapters")
    make_adapter(tiny_model_dir, root / "s1", seed=5, r=4, lora_alpha=8, target_modules=["q_proj"])
    # adapters=[]: no shipped inventory (main ships demo adapters outside this test's adapter root).
    overrides = ("server.port=0", "adapters=[]", f"model.path={tiny_model_dir}", "model.name=tiny",
                 "model.max_model_len=128", "model.device=cpu", "server.api_keys=[${oc.env:SEC_TEST_API_KEY}]",
                 "lora.enabled=true",
                 f"lora.adapter_roots=[{root}]", "lora.max_lora_rank=8", "reconcile.watch=false",
                 "reconcile.resync_s=0", "server.log_level=debug")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPLIANCE_ADMIN_KEY", ADMIN_SECRET)  # configs/server/default.yaml interpolates it
        mp.setenv("SEC_TEST_API_KEY", API_SECRET)
        cfg = compose_config(REPO / "configs", list(overrides))
        assert cfg.server.admin_key == ADMIN_SECRET and cfg.server.api_keys == [API_SECRET]
        srv = ServerThread(cfg, ConfigSource(REPO / "configs", overrides)).start()
    yield srv, root
    srv.stop()


def test_keys_never_leave_the_server(env_server: tuple[ServerThread, Path], caplog: pytest.LogCaptureFixture,
                                     capfd: pytest.CaptureFixture) -> None:
    srv, root = env_server
    caplog.set_level(logging.DEBUG)
    api, adm = {"Authorization": f"Bearer {API_SECRET}"}, {"Authorization": f"Bearer {ADMIN_SECRET}"}
    wrong = {"Authorization": f"Bearer {API_SECRET[:-1]}X"}
    body = {"model": "tiny", "prompt": [1, 504], "max_tokens": 2}
    answers = [
        requests.post(srv.url + "/v1/completions", json=body, timeout=30),
        requests.post(srv.url + "/v1/completions", json=body, headers=wrong, timeout=30),
        requests.post(srv.url + "/v1/completions", json=body, headers=api, timeout=30),
        requests.post(srv.url + "/load_lora_adapter", headers=api, timeout=30,
                      json={"lora_name": "s1", "lora_path": str(root / "s1")}),
        requests.post(srv.url + "/load_lora_adapter", headers=adm, timeout=30,
                      json={"lora_name": "s1", "lora_path": str(root / "s1")}),
        requests.post(srv.url + "/load_lora_adapter", headers=adm, timeout=30,
                      json={"lora_name": "s2", "lora_path": "/etc"}),
        requests.get(srv.url + "/v1/status", headers=adm, timeout=30),
        requests.get(srv.url + "/v1/adapters", headers=adm, timeout=30),
        requests.get(srv.url + "/v1/models", headers=api, timeout=30),
        requests.get(srv.url + "/openapi.json", timeout=30),
    ]
    assert [r.status_code for r in answers] == [401, 401, 200, 401, 200, 400, 200, 200, 200, 200]
    status = answers[6].json()
    assert "server.api_keys=***" in status["config"]["overrides"]
    assert not any(k in status["settings"] for k in ("server.api_keys", "server.admin_key"))
    rt = status["runtime"]  # every auto resolved once at start (engine/runtime.py); cpu takes the torch paths
    assert (rt["device"], rt["attention_backend"], rt["decode_graphs"], rt["async_scheduling"]) == ("cpu", "torch",
                                                                                                  False, False)
    assert rt["lora"]["backend"] == "torch" and rt["lora"]["prefill_gemm"] is None
    out, err = capfd.readouterr()
    seen = [r.text + str(dict(r.headers)) for r in answers] + [caplog.text, out, err]
    for secret in (ADMIN_SECRET, API_SECRET):
        assert not any(secret in s for s in seen), f"a key leaked: {secret}"


def test_key_comparison_is_constant_time_over_every_key() -> None:
    keys = [b"alpha-key", b"beta-key-longer"]
    assert keys_match(b"beta-key-longer", keys) and keys_match(b"alpha-key", keys)
    assert not keys_match(b"alpha-ke", keys) and not keys_match(b"", keys) and not keys_match(b"x" * 1000, keys)
    # The comparison itself: digests of equal length through hmac.compare_digest, no == on secrets.
    src = (REPO / "appliance/server/auth.py").read_text()
    assert "compare_digest" in src and "sha256" in src
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            assert not names & {"token", "key", "keys", "digest"}, ast.unparse(node)


@pytest.mark.parametrize("override, shown", [
    ("server.admin_key=hunter2", "server.admin_key=***"),
    ("+server.api_keys=[a,b]", "+server.api_keys=***"),
    ("server.admin_key=${oc.env:X}", "server.admin_key=***"),
    ("server.port=9000", "server.port=9000"),
    ("lora.enabled=true", "lora.enabled=true"),
])
def test_status_masks_secret_overrides(override: str, shown: str) -> None:
    assert mask_override(override) == shown


# Modules and calls that deserialize pickle (or run code from a checkpoint); none may appear.
_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
_PICKLE_CALLS = {"torch.load", "torch.jit.load", "torch.serialization.load", "numpy.load", "np.load"}
_BAD_KEYWORDS = {("weights_only", False), ("allow_pickle", True), ("trust_remote_code", True),
                 ("use_safetensors", False)}


def test_no_pickle_anywhere() -> None:
    found = []
    for pkg in ("appliance", "kernels"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Import):
                    found += [f"{where}: import {a.name}" for a in node.names
                              if a.name.split(".")[0] in _PICKLE_MODULES]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLE_MODULES:
                    found.append(f"{where}: from {node.module} import ...")
                elif isinstance(node, ast.Call):
                    name = ast.unparse(node.func)
                    if name in _PICKLE_CALLS:
                        found.append(f"{where}: {name}(...)")
                    for kw in node.keywords:
                        if isinstance(kw.value, ast.Constant) and (kw.arg, kw.value.value) in _BAD_KEYWORDS:
                            found.append(f"{where}: {kw.arg}={kw.value.value}")
    assert found == []


ROOT_MARK = "root-5ecret-4e2a"


@pytest.fixture()
def env_values_server(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[ServerThread, Path, Path, tuple, pytest.MonkeyPatch]]:
    """A server whose adapter root and max_num_seqs come from the environment, with an inventory
    adapter under that root and a resync every second (which composes again with the env of now)."""
    from tests.conftest import config_tree

    root = tmp_path / ROOT_MARK
    make_adapter(tiny_model_dir, root / "s1", seed=5, r=4, lora_alpha=8, target_modules=["q_proj"])
    tree = config_tree(tmp_path / "configs", "adapters:\n  inv:\n    path: ${oc.env:SEC_ROOT}/s1\n")
    overrides = ("server.port=0", f"model.path={tiny_model_dir}", "model.name=tiny", "model.max_model_len=128",
                 "model.device=cpu", "lora.enabled=true", "lora.adapter_roots=[${oc.env:SEC_ROOT}]",
                 "engine.max_num_seqs=${oc.env:SEC_SEQS}", "lora.max_lora_rank=8", "server.admin_key=adm",
                 "reconcile.watch=false", "reconcile.resync_s=1", "server.log_level=debug")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SEC_ROOT", str(root))
        mp.setenv("SEC_SEQS", "8")
        srv = ServerThread(compose_config(tree, list(overrides)), ConfigSource(tree, overrides)).start()
        try:
            yield srv, root, tree, overrides, mp
        finally:
            srv.stop()


def test_values_from_the_environment_are_never_echoed(env_values_server, caplog: pytest.LogCaptureFixture,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Issue 29: a value that came from ${oc.env:VAR} shows as <from env VAR> in /v1/status (settings,
    restart-required diff, conditions), error messages, logs and `appliance plan`."""
    import time

    from appliance.cli import main

    srv, root, tree, overrides, mp = env_values_server
    caplog.set_level(logging.DEBUG)
    adm = {"Authorization": "Bearer adm"}
    status = requests.get(srv.url + "/v1/status", headers=adm, timeout=30).json()
    assert status["settings"]["lora.adapter_roots"] == "<from env SEC_ROOT>"
    assert status["settings"]["engine.max_num_seqs"] == "<from env SEC_SEQS>"
    models = requests.get(srv.url + "/v1/models", timeout=30).text  # the inventory adapter's card
    assert "<from env SEC_ROOT>/s1" in models, models
    bad = requests.post(srv.url + "/load_lora_adapter", headers=adm, timeout=30,
                        json={"lora_name": "x", "lora_path": "/etc"})
    assert bad.status_code == 400 and "<from env SEC_ROOT>" in bad.json()["error"]["message"], bad.text
    # A restart-only value changed in the environment: reported by key, without either value.
    mp.setenv("SEC_SEQS", "9")
    deadline = time.monotonic() + 30
    while not status["restart_required"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
        status = requests.get(srv.url + "/v1/status", headers=adm, timeout=30).json()
    assert status["restart_required"] == ["engine.max_num_seqs: changed (from env SEC_SEQS; requires restart)"]
    # The plan from outside: the inventory adapter unloaded live, so the plan loads it again.
    assert requests.post(srv.url + "/unload_lora_adapter", headers=adm, json={"lora_name": "inv"},
                         timeout=30).status_code == 200
    mp.setenv("SEC_SEQS", "8")
    capsys.readouterr()
    assert main(["plan", "--config-dir", str(tree), "--url", srv.url, *overrides]) == 0
    plan_out = capsys.readouterr().out
    assert "+ inv: load (not loaded (<from env SEC_ROOT>/s1))" in plan_out, plan_out
    texts = [json.dumps(status), bad.text, plan_out, caplog.text, models]
    assert not [t for t in texts if ROOT_MARK in t or "SEC_SEQS=9" in t], texts


def test_a_request_without_a_key_is_refused_before_its_body_is_read(env_server: tuple[ServerThread, Path]) -> None:
    """Bodies are read before a request takes a concurrency slot (issue 29), but never for a client
    without a valid key: a never-ending body without one gets 401 at once, not a read and a 408."""
    import socket
    import time

    srv, _ = env_server
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n")
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 401"), head
    assert time.monotonic() - t0 < 10  # the body timeout is 30 s
