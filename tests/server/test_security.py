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
