"""Issue 29, the server half: input an attacker sends to a live server, as tests on a real uvicorn.

- malformed Unicode (an unpaired surrogate escape, JSON "\\ud800") anywhere in a body: 400, never 500;
- adapter names: one rule (lora/names.py) on the admin API; a 404 for an unknown model stays small;
  Prometheus label values come only from registered names;
- per-request bounds: stop strings, /generate batch size, slow bodies and concurrency slots.

One server: the tiny random model, LoRA on with one adapter "a1", admin key "secret".
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from tests.lora.test_lora_engine import make_adapter
from tests.server.conftest import ServerThread, start_with_adapter

ADMIN = {"Authorization": "Bearer secret"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    make_adapter(tiny_model_dir, root / "a1", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    return root


@pytest.fixture(scope="module")
def srv(root: Path, tiny_model_dir: Path) -> Iterator[ServerThread]:
    srv = start_with_adapter(tiny_model_dir, root, "a1", "secret", "model.max_model_len=256",
                             "reconcile.watch=false", "reconcile.resync_s=0", "server.max_concurrent_requests=4",
                             "server.body_timeout_s=2", "server.max_prompts_per_request=8",
                             "server.prompts_in_flight_per_request=2")
    yield srv
    srv.stop()


def post_raw(srv: ServerThread, path: str, raw: str, headers: dict | None = None) -> requests.Response:
    return requests.post(srv.url + path, data=raw.encode(), timeout=60,
                         headers={"Content-Type": "application/json", **(headers or {})})


def error(r: requests.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def with_surrogate(body: dict, *keys: Any) -> str:
    """`body` as JSON with the string at `keys` replaced by one holding an unpaired surrogate escape
    (json.dumps cannot write one, so a marker is swapped for the raw escape)."""
    body = json.loads(json.dumps(body))
    node = body
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = "x@@SURROGATE@@y"
    return json.dumps(body).replace("@@SURROGATE@@", "\\ud800")


# ---------------------------------------------------------------------------------- 1. Unicode

SURROGATE_CASES = [
    ("completion prompt", "/v1/completions", with_surrogate(COMPLETION, "prompt"), {}, "prompt"),
    ("completion model", "/v1/completions", with_surrogate(COMPLETION, "model"), {}, "model"),
    ("chat content", "/v1/chat/completions", with_surrogate(CHAT, "messages", 0, "content"), {},
     "messages[0].content"),
    ("chat role", "/v1/chat/completions", with_surrogate(CHAT, "messages", 0, "role"), {}, "messages[0].role"),
    ("generate text", "/generate", with_surrogate(GENERATE, "text"), {}, "text"),
    ("generate lora_path", "/generate", with_surrogate({**GENERATE, "lora_path": "a1"}, "lora_path"), {},
     "lora_path"),
    ("generate stop", "/generate", with_surrogate({**GENERATE, "sampling_params": {"stop": ["a"]}},
                                                  "sampling_params", "stop", 0), {}, "sampling_params.stop[0]"),
    ("unknown field name", "/v1/completions", json.dumps(COMPLETION)[:-1] + ', "\\ud800": 1}', {}, None),
    ("unknown generate field", "/generate", json.dumps(GENERATE)[:-1] + ', "a\\udfffb": 1}', {}, None),
    ("admin lora_name", "/load_lora_adapter", with_surrogate({"lora_name": "n", "lora_path": "/x"}, "lora_name"),
     ADMIN, "lora_name"),
    ("admin lora_path", "/load_lora_adapter", with_surrogate({"lora_name": "n", "lora_path": "/x"}, "lora_path"),
     ADMIN, "lora_path"),
    ("unload lora_name", "/unload_lora_adapter", with_surrogate({"lora_name": "n"}, "lora_name"), ADMIN,
     "lora_name"),
]


@pytest.mark.parametrize("case, path, raw, headers, param", SURROGATE_CASES, ids=[c[0] for c in SURROGATE_CASES])
def test_unpaired_surrogate_is_400(srv: ServerThread, case: str, path: str, raw: str, headers: dict,
                                   param: str | None) -> None:
    r = post_raw(srv, path, raw, headers)
    assert r.status_code == 400, r.text
    err = error(r)
    assert err["param"] == param and "not valid Unicode text" in err["message"], err
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200


def test_paired_surrogates_are_text(srv: ServerThread) -> None:
    """A surrogate pair escape is one valid character (an emoji): accepted as before."""
    r = post_raw(srv, "/v1/completions", json.dumps(COMPLETION).replace('"hi"', '"hi \\ud83d\\ude00"'))
    assert r.status_code == 200, r.text


NESTED = {"arrays": "[" * 100_000, "objects": '{"a":' * 100_000, "in a field": '{"model": "tiny", "prompt": ' + "[" * 3000}


@pytest.mark.parametrize("case", sorted(NESTED))
def test_deeply_nested_body_is_400(srv: ServerThread, case: str) -> None:
    r = post_raw(srv, "/v1/completions", NESTED[case])
    assert r.status_code == 400, r.text
    assert "not valid JSON" in error(r)["message"]


# ---------------------------------------------------------------------------------- 2. names

BAD_NAMES = [("newline", "a\nb"), ("carriage return", "a\rb"), ("NUL", "a\x00b"), ("ANSI escape", "\x1b[31mred"),
             ("bidi override", "abc\u202edef"), ("zero width", "a\u200bb"), ("too long", "n" * 129),
             ("surrounding space", " a"), ("colon", "a:b"), ("tab", "a\tb")]


@pytest.mark.parametrize("case, name", BAD_NAMES, ids=[c[0] for c in BAD_NAMES])
def test_admin_refuses_names_outside_the_rule(srv: ServerThread, root: Path, case: str, name: str) -> None:
    r = requests.post(srv.url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                      json={"lora_name": name, "lora_path": str(root / "a1")})
    assert r.status_code == 400, r.text
    err = error(r)
    assert err["param"] == "lora_name" and "nvalid adapter name" in err["message"], err
    assert len(err["message"]) < 400  # a long name comes back cut
    names = [a["name"] for a in requests.get(srv.url + "/v1/adapters", headers=ADMIN, timeout=30).json()["data"]]
    assert names == ["a1"]


def test_longest_printable_name_is_accepted(srv: ServerThread, root: Path) -> None:
    name = "é" * 64 + "-" * 63 + "z"  # 128 characters, non-ASCII but printable
    r = requests.post(srv.url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                      json={"lora_name": name, "lora_path": str(root / "a1")})
    assert r.status_code == 200, r.text
    assert requests.post(srv.url + "/unload_lora_adapter", headers=ADMIN, json={"lora_name": name},
                         timeout=30).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**COMPLETION, "model": "m" * 1_000_000}),
    ("/v1/completions", {**COMPLETION, "model": "tiny:" + "m" * 1_000_000}),
    ("/generate", {**GENERATE, "lora_path": "m" * 1_000_000}),
    ("/unload_lora_adapter", {"lora_name": "m" * 1_000_000}),
    ("/v1/completions", {**COMPLETION, "m" * 1_000_000: 1, "suffix": "x"}),
    ("/generate", {**GENERATE, "m" * 1_000_000: 1}),
])
def test_errors_do_not_echo_megabytes(srv: ServerThread, path: str, body: dict) -> None:
    r = requests.post(srv.url + path, json=body, headers=ADMIN, timeout=60)
    assert 400 <= r.status_code < 500, r.text[:300]
    error(r)
    assert len(r.content) < 2000, r.content[:300]


def test_metric_labels_come_only_from_registered_names(srv: ServerThread) -> None:
    for model in ["a1", "tiny:a1", "nope\nfake_metric 1", "tiny:\x1b[2Jx", "\u202eevil"]:
        requests.post(srv.url + "/v1/completions", json={**COMPLETION, "model": model}, timeout=60)
    text = requests.get(srv.url + "/metrics", timeout=30).text
    labels = {line.split('adapter="')[1].split('"')[0] for line in text.splitlines() if 'adapter="' in line}
    assert labels <= {"base", "other", "a1"}, labels
    assert "fake_metric" not in text and "\x1b" not in text and "\u202e" not in text


# ---------------------------------------------------------------------------------- 4. fair limits

@pytest.mark.parametrize("stop, ok", [
    (["s"] * 17, False), (["s" * 1025], False), (["s" * 512, "t" * 513], False),  # count, length, total
    (["s" * 64] * 16, True),  # at both bounds
])
def test_stop_strings_are_bounded(srv: ServerThread, stop: list[str], ok: bool) -> None:
    for path, body, param in [("/v1/completions", {**COMPLETION, "stop": stop}, "stop"),
                              ("/generate", {**GENERATE, "sampling_params": {"stop": stop}}, "sampling_params.stop")]:
        r = requests.post(srv.url + path, json=body, timeout=60)
        if ok:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 400, r.text
            err = error(r)
            assert err["param"] == param and "server.max_stop_" in err["message"], err


@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"text": ["a"] * 9, "sampling_params": {"max_new_tokens": 1}}, "text"),
    ("/generate", {"input_ids": [[1, 2]] * 9, "sampling_params": {"max_new_tokens": 1}}, "input_ids"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 9}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2]] * 9}, "prompt"),
])
def test_prompts_per_request_are_bounded(srv: ServerThread, path: str, body: dict, param: str) -> None:
    r = requests.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = error(r)
    assert err["param"] == param and "server.max_prompts_per_request" in err["message"], err


def test_a_large_batch_is_admitted_in_pieces(srv: ServerThread) -> None:
    """server.prompts_in_flight_per_request=2: a batch of 8 has 2 prompts in the engine at a time, so a
    request sent after it enters the engine's FIFO queue before the batch's third prompt."""
    from tests.server.engine_hold import engine_held
    from tests.server.test_limits import wait_until

    batch = {"input_ids": [[1, 504, 3458]] * 8, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    out: dict[str, requests.Response] = {}

    def call(key: str, path: str, body: dict) -> None:
        out[key] = requests.post(srv.url + path, json=body, timeout=120)

    import threading

    with engine_held(srv.engine):
        a = threading.Thread(target=call, args=("batch", "/generate", batch), daemon=True)
        a.start()
        wait_until(lambda: srv.engine.num_in_flight == 2)
        time.sleep(0.3)  # were the batch admitted whole, the rest would arrive now
        assert srv.engine.num_in_flight == 2
        b = threading.Thread(target=call, args=("single", "/v1/completions", COMPLETION), daemon=True)
        b.start()
        wait_until(lambda: srv.engine.num_in_flight == 3)
    a.join(120)
    b.join(120)
    assert out["single"].status_code == 200, out["single"].text
    assert out["batch"].status_code == 200 and len(out["batch"].json()) == 8
    assert all(item["meta_info"]["completion_tokens"] == 3 for item in out["batch"].json())
    assert srv.wait_idle()


def test_unfinished_bodies_hold_no_slot(srv: ServerThread) -> None:
    """More never-ending chunked bodies than server.max_concurrent_requests (4): a complete request
    still gets a slot, and each unfinished one is answered 408 after server.body_timeout_s (2 s)."""
    limit = srv.server.config.app.state.limit
    socks = []
    for _ in range(6):
        s = socket.create_connection(("127.0.0.1", srv.server.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n")
        socks.append(s)
    from tests.server.test_limits import wait_until

    time.sleep(1.0)  # uvicorn has accepted them and called the app, which waits for their bodies
    t0 = time.monotonic()
    r = requests.post(srv.url + "/v1/completions", json=COMPLETION, timeout=60)
    assert r.status_code == 200, r.text
    for s in socks:
        data = b""
        while not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert "server.body_timeout_s" in json.loads(body)["error"]["message"]
    assert time.monotonic() - t0 < 20
    wait_until(lambda: limit.reading == 0 and limit.active == 0)
