"""Tenants on a real server (uvicorn, the tiny model, peft-made adapters) with the official openai client:
every refusal path with its status, error shape and Retry-After; scoped /v1/models; scoped admin
roles and `appliance plan` with a read key; key rotation through hot reload with requests in flight;
no key, digest or secret in logs, /v1/status or /metrics."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import openai
import pytest
import requests

from appliance.config.compose import compose_config
from appliance.reconcile.controller import ConfigSource
from tests.lora.test_lora_engine import make_adapter
from tests.reconcile.trees import KEY as ADMIN_KEY, rename_save, wait_for, write_tree
from tests.server.conftest import ServerThread

# Keys come from the environment, as operators set them; values long enough to be redacted.
ENV = {"T_KEY_A": "alpha-key-0123456789", "T_KEY_A2": "alpha-key-rotated-9876", "T_KEY_B": "bravo-key-0123456789",
       "T_KEY_R": "rate-key-0123456789", "T_KEY_C": "conc-key-0123456789", "T_KEY_T": "tok-key-0123456789",
       "T_KEY_RO": "read-key-0123456789"}
SECRETS = [*ENV.values(), *(hashlib.sha256(v.encode()).hexdigest() for v in ENV.values())]
PROMPT = [1, 504, 3458, 282, 4649, 314]


def tenants_yaml(a_keys: str = '["${oc.env:T_KEY_A}"]', a_weight: str = "1") -> str:
    return f"""team-a:
  keys: {a_keys}
  adapters: ["a-*"]
  weight: {a_weight}
team-b:
  keys: ["${{oc.env:T_KEY_B}}"]
  adapters: ["b-one"]
  allow_base: false
  admin: admin
rate:
  keys: ["${{oc.env:T_KEY_R}}"]
  limits: {{requests_per_s: 0.01, burst: 1}}
conc:
  keys: ["${{oc.env:T_KEY_C}}"]
  limits: {{max_concurrent: 1}}
tok:
  keys: ["${{oc.env:T_KEY_T}}"]
  limits: {{tokens_per_min: 60, max_tokens_per_request: 20}}
ro:
  keys: ["${{oc.env:T_KEY_RO}}"]
  admin: read
"""


@pytest.fixture(scope="module")
def env() -> Iterator[None]:
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, env: None) -> Path:
    root = tmp_path_factory.mktemp("tenant-adapters")
    for i, name in enumerate(["a-one", "b-one"]):
        make_adapter(tiny_model_dir, root / name, seed=70 + i, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    tree = write_tree(tmp_path_factory.mktemp("tenant-tree") / "configs", tiny_model_dir, root,
                      {"inv": {"a-one": {"path": root / "a-one"}, "b-one": {"path": root / "b-one"}}}, watch=True)
    (tree / "tenants" / "default.yaml").write_text(tenants_yaml())
    return tree


@pytest.fixture(scope="module")
def srv(tree: Path) -> Iterator[ServerThread]:
    s = ServerThread(compose_config(tree, ["server.port=0"]), ConfigSource(tree, ("server.port=0",))).start()
    yield s
    s.stop()


def client(srv: ServerThread, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key or "unused", max_retries=0,
                         default_headers={} if key else {"Authorization": ""})


def complete(srv: ServerThread, key: str, model: str, **kw) -> openai.types.Completion:
    return client(srv, key).completions.create(model=model, prompt=PROMPT, max_tokens=kw.pop("max_tokens", 4),
                                               temperature=0, **kw)


def error_of(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_unknown_or_missing_key_is_401(srv: ServerThread) -> None:
    for key in (None, "not-a-key"):
        with pytest.raises(openai.AuthenticationError) as e:
            complete(srv, key, "tiny")
        assert error_of(e.value)["code"] == "invalid_api_key"


def test_models_lists_only_what_the_key_may_use(srv: ServerThread) -> None:
    assert sorted(m.id for m in client(srv, ENV["T_KEY_A"]).models.list()) == ["a-one", "tiny"]
    assert sorted(m.id for m in client(srv, ENV["T_KEY_B"]).models.list()) == ["b-one"]
    assert sorted(m.id for m in client(srv, ENV["T_KEY_R"]).models.list()) == ["tiny"]


def test_another_tenants_adapter_answers_as_a_nonexistent_one(srv: ServerThread) -> None:
    assert complete(srv, ENV["T_KEY_A"], "a-one").choices[0].text is not None
    assert complete(srv, ENV["T_KEY_B"], "b-one").choices[0].text is not None
    bodies = []
    for model in ("b-one", "b-xyz"):  # b-one exists, for team-b only; b-xyz exists for nobody
        with pytest.raises(openai.NotFoundError) as e:
            complete(srv, ENV["T_KEY_A"], model)
        bodies.append(e.value.response.text.replace(model, "NAME"))
    assert bodies[0] == bodies[1]
    assert "b-one" not in json.dumps(error_of(e.value))  # no listing of other tenants' names
    r = requests.post(srv.url + "/tokenize", json={"model": "b-one", "prompt": "hi"},
                      headers={"Authorization": f"Bearer {ENV['T_KEY_A']}"}, timeout=30)
    assert r.status_code == 404
    with pytest.raises(openai.PermissionDeniedError) as e:  # team-b: allow_base false
        complete(srv, ENV["T_KEY_B"], "tiny")
    assert error_of(e.value)["code"] == "model_not_allowed"


def test_rate_limit_429_with_retry_after(srv: ServerThread) -> None:
    complete(srv, ENV["T_KEY_R"], "tiny")  # the burst of 1
    with pytest.raises(openai.RateLimitError) as e:
        complete(srv, ENV["T_KEY_R"], "tiny")
    err = error_of(e.value)
    assert err["type"] == "rate_limit_error" and err["code"] == "requests_per_s"
    assert int(e.value.response.headers["retry-after"]) >= 1
    complete(srv, ENV["T_KEY_A"], "tiny")  # other tenants are not touched


def test_concurrency_limit_429(srv: ServerThread) -> None:
    c = client(srv, ENV["T_KEY_C"])
    stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, stream=True,
                                  extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # the stream holds the tenant's one slot
        with pytest.raises(openai.RateLimitError) as e:
            complete(srv, ENV["T_KEY_C"], "tiny")
        assert error_of(e.value)["code"] == "tenant_concurrency" and e.value.response.headers["retry-after"]
    finally:
        stream.close()
    wait_for(lambda: _succeeds(srv, ENV["T_KEY_C"]), 10)  # the slot came back


def _succeeds(srv: ServerThread, key: str) -> bool:
    try:
        complete(srv, key, "tiny")
        return True
    except openai.RateLimitError:
        return False


def test_token_limits(srv: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        complete(srv, ENV["T_KEY_T"], "tiny", max_tokens=21)
    assert error_of(e.value)["param"] == "max_tokens"
    complete(srv, ENV["T_KEY_T"], "tiny", max_tokens=20, extra_body={"ignore_eos": True})  # 26 of 60
    complete(srv, ENV["T_KEY_T"], "tiny", max_tokens=20, extra_body={"ignore_eos": True})  # 52 of 60
    with pytest.raises(openai.RateLimitError) as e:
        complete(srv, ENV["T_KEY_T"], "tiny", max_tokens=20)
    assert error_of(e.value)["code"] == "tokens_per_min" and int(e.value.response.headers["retry-after"]) >= 1


def test_admin_roles(srv: ServerThread, tree: Path) -> None:
    def call(key: str, route: str, body: dict | None = None) -> requests.Response:
        h = {"Authorization": f"Bearer {key}"}
        if body is None:
            return requests.get(srv.url + route, headers=h, timeout=30)
        return requests.post(srv.url + route, headers=h, json=body, timeout=30)

    assert call(ENV["T_KEY_RO"], "/v1/status").status_code == 200
    assert call(ENV["T_KEY_RO"], "/v1/adapters").status_code == 200
    r = call(ENV["T_KEY_RO"], "/pin_lora_adapter", {"lora_name": "a-one", "pinned": True})
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_role"
    assert call(ENV["T_KEY_A"], "/v1/status").status_code == 403  # admin: none
    assert call("not-a-key", "/v1/status").status_code == 401
    for pinned in (True, False):  # team-b has the admin role
        assert call(ENV["T_KEY_B"], "/pin_lora_adapter", {"lora_name": "a-one", "pinned": pinned}).status_code == 200
    # `appliance plan` reads /v1/adapters and /v1/status: a read key is enough.
    p = subprocess.run([sys.executable, "-m", "appliance", "plan", "--config-dir", str(tree), "--url", srv.url,
                        "server.admin_key=${oc.env:T_KEY_RO}"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **ENV})
    assert p.returncode == 0, p.stdout + p.stderr


def test_no_secret_in_status_metrics_or_logs(srv: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for key in (ENV["T_KEY_A"], "wrong-key-0123456789"):
        try:
            complete(srv, key, "b-one")
        except openai.APIStatusError:
            pass
    h = {"Authorization": f"Bearer {ADMIN_KEY}"}
    texts = [requests.get(srv.url + "/v1/status", headers=h, timeout=30).text,
             requests.get(srv.url + "/metrics", timeout=30).text, caplog.text]
    for text in texts:
        for secret in SECRETS:
            assert secret not in text
    metrics = texts[1]
    assert 'appliance_tenant_requests_total{tenant="team-a"}' in metrics
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("appliance_tenant_")}
    assert series['appliance_tenant_rejections_total{reason="requests_per_s",tenant="rate"}'] >= 1
    assert series['appliance_tenant_requests_total{tenant="team-a"}'] >= 2
    assert series['appliance_tenant_tokens_total{kind="completion",tenant="team-a"}'] >= 4
    assert series['appliance_tenant_queue_time_seconds_count{tenant="team-a"}'] >= 1


def test_key_rotation_through_hot_reload_with_requests_in_flight(srv: ServerThread, tree: Path) -> None:
    """Add the new key, move clients over, drop the old one: requests in flight on the old key finish."""
    f = tree / "tenants" / "default.yaml"
    old, new = ENV["T_KEY_A"], ENV["T_KEY_A2"]
    rename_save(f, tenants_yaml(a_keys='["${oc.env:T_KEY_A}", "${oc.env:T_KEY_A2}"]'))
    wait_for(lambda: _models_status(srv, new) == 200, 15)
    failures: list[str] = []
    done: list[int] = []

    def stream_on_old_key() -> None:
        try:
            s = client(srv, old).completions.create(model="a-one", prompt=PROMPT, max_tokens=60, stream=True,
                                                    extra_body={"ignore_eos": True})
            done.append(sum(1 for c in s if c.choices and c.choices[0].text))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            failures.append(repr(e))

    threads = [threading.Thread(target=stream_on_old_key) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: srv.engine.num_in_flight > 0 or len(done) == 3, 10)
    rename_save(f, tenants_yaml(a_keys='["${oc.env:T_KEY_A2}"]'))  # the old key leaves
    wait_for(lambda: _models_status(srv, old) == 401, 15)
    for t in threads:
        t.join(timeout=120)
    assert failures == [] and len(done) == 3, failures
    assert complete(srv, new, "a-one").choices
    # An invalid tenants file leaves the last good table serving; the error names the file and key.
    rename_save(f, tenants_yaml(a_keys='["${oc.env:T_KEY_A2}"]', a_weight="0"))
    h = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def config_valid() -> dict:
        st = requests.get(srv.url + "/v1/status", headers=h, timeout=30).json()
        return next(c for c in st["conditions"] if c["type"] == "ConfigValid")

    wait_for(lambda: config_valid()["status"] == "False", 15)
    assert "tenants/default.yaml: tenants.team-a.weight" in config_valid()["message"]
    assert complete(srv, new, "a-one").choices and _models_status(srv, old) == 401
    rename_save(f, tenants_yaml(a_keys='["${oc.env:T_KEY_A2}"]'))
    wait_for(lambda: config_valid()["status"] == "True", 15)


def _models_status(srv: ServerThread, key: str) -> int:
    return requests.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code
