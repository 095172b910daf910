"""Multi-LoRA over HTTP against peft: model resolution, /v1/models, /generate lora_path, the admin API,
unload and in-place reload under traffic, and every bad input of issue 3 ("nothing changes").

One server for the module: the tiny random model, lora.max_lora_rank=8, two GPU slots (so at most one
pinned adapter, and the mixed batch must wait for slots), admin key "secret". Adapters are made with
peft in the test; the expected tokens are peft's own greedy tokens for each adapter alone.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import openai
import pytest
import requests

from appliance.engine.tokenizer import Tokenizer
from tests.lora.test_lora_engine import ADAPTERS, NEW, PROMPTS, make_adapter, peft_greedy
from tests.server.conftest import ServerThread, start_server

MODEL = "tiny"
ADMIN = {"Authorization": "Bearer secret"}
SERVED = ["qv4", "all8rs", "pattern", "mlp6"]  # loaded for the whole module, unpinned
N_PROMPTS = 2
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


# ---------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """The good adapters (ADAPTERS) and one directory per bad input, inside `root` unless noted."""
    base = tmp_path_factory.mktemp("lora")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    dirs = {name: make_adapter(tiny_model_dir, root / name, seed=i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    dirs["root"] = root
    dirs["rank16"] = make_adapter(tiny_model_dir, root / "rank16", seed=10, r=16, lora_alpha=16,
                                  target_modules=["q_proj"])
    dirs["dora"] = make_adapter(tiny_model_dir, root / "dora", seed=11, r=4, lora_alpha=8,
                                target_modules=["q_proj", "v_proj"], use_dora=True)
    dirs["binonly"] = _save_as_bin(tiny_model_dir, dirs["qv4"], root / "binonly")
    trunc = shutil.copytree(dirs["qv4"], root / "truncated")
    weights = trunc / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    dirs["truncated"] = trunc
    # A valid adapter outside the root, reached by `..` and by a symlink inside the root.
    dirs["outside"] = shutil.copytree(dirs["qv4"], outside / "qv4copy")
    (root / "link").symlink_to(dirs["outside"], target_is_directory=True)
    return dirs


def _save_as_bin(base_dir: Path, adapter_dir: Path, dest: Path) -> Path:
    """The same adapter as peft writes it with safe_serialization=False: adapter_model.bin only."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    model.save_pretrained(dest, safe_serialization=False)
    assert (dest / "adapter_model.bin").is_file() and not (dest / "adapter_model.safetensors").exists()
    return dest


@pytest.fixture(scope="module")
def oracle(lora_dirs: dict[str, Path], tiny_model_dir: Path) -> dict[Optional[str], list[list[int]]]:
    """Adapter name (None = base) -> peft's greedy tokens for each of the first N_PROMPTS prompts."""
    tok = Tokenizer(tiny_model_dir)
    ids = [tok.encode(p) for p in PROMPTS[:N_PROMPTS]]
    names: list[Optional[str]] = [None, *ADAPTERS]
    return {n: peft_greedy(tiny_model_dir, lora_dirs[n] if n else None, ids)[0] for n in names}


@pytest.fixture(scope="module")
def srv(lora_dirs: dict[str, Path], tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = start_server(f"model.path={tiny_model_dir}", f"model.name={MODEL}", "model.max_model_len=512",
                          "model.device=cpu", "engine.num_kv_blocks=256", "lora.enabled=true",
                          "lora.max_lora_rank=8", "lora.max_loras_per_batch=2",
                          f"lora.adapter_roots=[{lora_dirs['root']}]", "server.admin_key=secret")
    for name in SERVED:
        r = load(server, name, lora_dirs[name])
        assert r.status_code == 200, r.text
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


# ---------------------------------------------------------------------------------- helpers

def load(srv: ServerThread, name: str, path: Path | str, headers: Optional[dict] = None,
         **extra: Any) -> requests.Response:
    return requests.post(srv.url + "/load_lora_adapter", headers=ADMIN if headers is None else headers,
                         json={"lora_name": name, "lora_path": str(path), **extra}, timeout=60)


def unload(srv: ServerThread, name: str, prefix: str = "") -> requests.Response:
    return requests.post(srv.url + prefix + "/unload_lora_adapter", headers=ADMIN,
                         json={"lora_name": name}, timeout=60)


def adapters(srv: ServerThread) -> dict:
    r = requests.get(srv.url + "/v1/adapters", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def by_name(state: dict) -> dict[str, dict]:
    return {a["name"]: a for a in state["data"]}


def generate(srv: ServerThread, text: str | list[str], lora_path: Any = None,
             sampling: Optional[dict] = None, **extra: Any) -> requests.Response:
    body = {"text": text, "sampling_params": sampling or GREEDY, **extra}
    if lora_path is not None:
        body["lora_path"] = lora_path
    return requests.post(srv.url + "/generate", json=body, timeout=60)


def error_of(r: requests.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def assert_still_serving(srv: ServerThread, client: openai.OpenAI, oracle: dict) -> None:
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    base = generate(srv, PROMPTS[0])
    assert base.status_code == 200 and base.json()["output_ids"] == oracle[None][0]
    out = client.completions.create(model="qv4", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == NEW


# ---------------------------------------------------------------------------------- serving

def test_models_lists_each_adapter_as_a_card(srv: ServerThread, client: openai.OpenAI,
                                             lora_dirs: dict[str, Path]) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL, *SERVED]
    cards = {c["id"]: c for c in requests.get(srv.url + "/v1/models", timeout=10).json()["data"]}
    assert cards[MODEL]["parent"] is None
    for name in SERVED:
        c = cards[name]
        assert c["object"] == "model" and c["owned_by"] == "appliance" and isinstance(c["created"], int)
        assert c["parent"] == MODEL and c["root"] == str(lora_dirs[name].resolve())


def test_completions_by_adapter_name_match_peft(srv: ServerThread, client: openai.OpenAI, oracle: dict,
                                                tok: Tokenizer) -> None:
    for name in SERVED:
        for model in (name, f"{MODEL}:{name}"):
            for p in range(N_PROMPTS):
                out = client.completions.create(model=model, prompt=PROMPTS[p], max_tokens=NEW, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert out.model == model
                assert out.choices[0].text == tok.decode(oracle[name][p]), (model, p)
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.model == name and chat.usage.completion_tokens >= 1
    # The adapters really differ from the base model and from each other (else this test is vacuous).
    assert len({tuple(oracle[n][0]) for n in [None, *SERVED]}) >= 4


def test_concurrent_mix_of_base_and_adapters(srv: ServerThread, oracle: dict, tok: Tokenizer) -> None:
    """Every adapter and the base model at once, through two GPU slots: peft-exact, nobody fails."""
    jobs = [(name, p) for name in [None, *SERVED] for p in range(N_PROMPTS)] * 2
    batch_paths = [None, "qv4", "all8rs", f"{MODEL}:pattern", "mlp6"]

    async def one(c: openai.AsyncOpenAI, name: Optional[str], p: int) -> str:
        out = await c.completions.create(model=name or MODEL, prompt=PROMPTS[p], max_tokens=NEW,
                                         temperature=0, stream=p == 1, extra_body={"ignore_eos": True})
        if p == 1:
            return "".join([ch.choices[0].text async for ch in out])
        return out.choices[0].text

    async def main() -> tuple[list[str], requests.Response]:
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            batch = asyncio.to_thread(generate, srv, [PROMPTS[0]] * len(batch_paths), batch_paths)
            *texts, r = await asyncio.gather(*(one(c, n, p) for n, p in jobs), batch)
            return texts, r
        finally:
            await c.close()

    texts, batch = asyncio.run(main())
    for (name, p), text in zip(jobs, texts):
        assert text == tok.decode(oracle[name][p]), (name, p)
    assert batch.status_code == 200, batch.text
    for path, item in zip(batch_paths, batch.json()):
        name = path.split(":")[-1] if path else None
        assert item["output_ids"] == oracle[name][0], path
    assert srv.wait_idle()
    state = adapters(srv)
    assert all(a["in_flight"] == 0 for a in state["data"]) and state["retiring"] == []
    assert state["pool"]["evictions"] > 0  # four adapters through two slots


def test_generate_lora_path(srv: ServerThread, oracle: dict) -> None:
    r = generate(srv, [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]],
                 ["qv4", None, f"{MODEL}:mlp6", "pattern"])
    assert r.status_code == 200, r.text
    got = [item["output_ids"] for item in r.json()]
    assert got == [oracle["qv4"][0], oracle[None][1], oracle["mlp6"][0], oracle["pattern"][1]]
    # One name for every input; the base model's name counts as "no adapter".
    r = generate(srv, [PROMPTS[0], PROMPTS[1]], "all8rs")
    assert [i["output_ids"] for i in r.json()] == oracle["all8rs"]
    assert generate(srv, PROMPTS[0], MODEL).json()["output_ids"] == oracle[None][0]
    assert generate(srv, PROMPTS[0], model="qv4").json()["output_ids"] == oracle["qv4"][0]
    # Streamed: cumulative output_ids per event.
    r = generate(srv, PROMPTS[1], "mlp6", stream=True)
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert events[-1]["output_ids"] == oracle["mlp6"][1]


@pytest.mark.parametrize("body, status, param, needle", [
    (dict(text=["a", "b"], lora_path=["qv4"]), 400, "lora_path", "one adapter name or null per input"),
    (dict(text="a", lora_path=["qv4"]), 400, "lora_path", "for a batch"),
    (dict(text="a", lora_path=7), 400, "lora_path", "adapter name"),
    (dict(text=["a", "b"], lora_path=["qv4", "nope"]), 404, "lora_path[1]", "'nope'"),
    (dict(text="a", lora_path="nope"), 404, "lora_path", "neither the base model"),
    (dict(text="a", lora_path="qv4", model="mlp6"), 400, "lora_path", "not both"),
])
def test_generate_lora_path_errors(srv: ServerThread, body: dict, status: int, param: str,
                                   needle: str) -> None:
    r = requests.post(srv.url + "/generate", json={"sampling_params": GREEDY, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize("model, needle", [
    ("nope", "neither the base model 'tiny' nor a loaded adapter"),
    ("other:qv4", "base 'other' is not served here"),
    (f"{MODEL}:nope", "adapter 'nope' is not loaded"),
])
def test_unknown_model_is_404(client: openai.OpenAI, model: str, needle: str) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found" and needle in e.value.message


def test_adapters_state(srv: ServerThread, client: openai.OpenAI, lora_dirs: dict[str, Path],
                        tiny_model_dir: Path) -> None:
    state = adapters(srv)
    assert state["enabled"] is True and [a["name"] for a in state["data"]] == SERVED
    a = by_name(state)["pattern"]
    assert a["path"] == str(lora_dirs["pattern"].resolve()) and a["pinned"] is False
    assert a["rank"] == 8 and a["target_modules"] == ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert len(a["checksum"]) == 64 and a["generation"] == 0 and a["in_flight"] == 0
    assert a["base_model_name"] == str(tiny_model_dir)  # as peft wrote it in adapter_config.json
    assert [x["id"] for x in state["data"]] == sorted(x["id"] for x in state["data"])
    assert state["pool"]["slots"] == 2 and state["pool"]["pinned_limit"] == 1
    # A request puts the adapter in a GPU slot; the others are then in the CPU tier (or on disk).
    client.completions.create(model="qv4", prompt="x", max_tokens=1)
    a = by_name(adapters(srv))["qv4"]
    assert a["tier"] == "gpu" and a["slot"] in (0, 1)
    assert {x["tier"] for x in adapters(srv)["data"]} <= {"gpu", "cpu", "disk"}


def test_unload_while_streaming_then_404(srv: ServerThread, client: openai.OpenAI, oracle: dict,
                                        lora_dirs: dict[str, Path]) -> None:
    assert load(srv, "stream", lora_dirs["qv4"]).status_code == 200
    long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}  # seconds: outlasts the unload
    ref = generate(srv, PROMPTS[0], "stream", long).json()["output_ids"]
    assert ref[:NEW] == oracle["qv4"][0] and len(ref) == 200

    r = requests.post(srv.url + "/generate", stream=True, timeout=60,
                      json={"text": PROMPTS[0], "sampling_params": long, "lora_path": "stream",
                            "stream": True})
    lines = r.iter_lines()
    first = next(line for line in lines if line)
    assert json.loads(first.removeprefix(b"data: "))["output_ids"]
    u = unload(srv, "stream", prefix="/v1")
    assert u.status_code == 200 and u.json()["in_flight"] == 1, u.text  # still running on its weights
    # Unregistered at once: new requests get 404 while the stream goes on.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="stream", prompt="x", max_tokens=1)
    assert generate(srv, PROMPTS[0], "stream").status_code == 404
    assert "stream" not in by_name(adapters(srv))
    events = [json.loads(line.removeprefix(b"data: ")) for line in lines
              if line and line != b"data: [DONE]"]
    assert events[-1]["output_ids"] == ref and events[-1]["meta_info"]["finish_reason"] == "length"
    assert srv.wait_idle()
    assert adapters(srv)["retiring"] == []  # its weights left once the stream finished
    assert unload(srv, "stream").status_code == 404


def test_load_inplace_changes_later_outputs(srv: ServerThread, client: openai.OpenAI, oracle: dict,
                                            lora_dirs: dict[str, Path]) -> None:
    r = load(srv, "swap", lora_dirs["qv4"])
    assert r.status_code == 200 and r.json()["adapter"]["generation"] == 0
    before = r.json()["adapter"]
    assert generate(srv, PROMPTS[0], "swap").json()["output_ids"] == oracle["qv4"][0]
    r = requests.post(srv.url + "/v1/load_lora_adapter", headers=ADMIN, timeout=60,
                      json={"lora_name": "swap", "lora_path": str(lora_dirs["all8rs"]), "load_inplace": True})
    assert r.status_code == 200, r.text
    after = r.json()["adapter"]
    assert after["id"] == before["id"] and after["generation"] == 1
    assert after["checksum"] != before["checksum"] and after["rank"] == 8
    assert generate(srv, PROMPTS[0], "swap").json()["output_ids"] == oracle["all8rs"][0]
    assert generate(srv, PROMPTS[1], f"{MODEL}:swap").json()["output_ids"] == oracle["all8rs"][1]
    # In-place reload of an unknown name: 404, nothing added.
    r = load(srv, "nobody", lora_dirs["qv4"], load_inplace=True)
    assert r.status_code == 404 and "nobody" not in by_name(adapters(srv))
    assert unload(srv, "swap").status_code == 200


def test_reload_in_place_under_traffic(srv: ServerThread, oracle: dict, lora_dirs: dict[str, Path]) -> None:
    """Requests racing in-place reloads all succeed, each on one whole version of the adapter."""
    assert load(srv, "flip", lora_dirs["qv4"]).status_code == 200
    results: list[requests.Response] = []
    lock = threading.Lock()

    def traffic() -> None:
        for _ in range(6):
            r = generate(srv, PROMPTS[0], "flip")
            with lock:
                results.append(r)

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(6):
        r = load(srv, "flip", lora_dirs["mlp6" if i % 2 == 0 else "qv4"], load_inplace=True)
        assert r.status_code == 200, r.text
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    versions = {tuple(oracle["qv4"][0]), tuple(oracle["mlp6"][0])}
    assert {tuple(r.json()["output_ids"]) for r in results} <= versions
    assert srv.wait_idle()
    assert unload(srv, "flip").status_code == 200
    assert adapters(srv)["retiring"] == []


def test_pinned_adapter_holds_a_gpu_slot(srv: ServerThread, lora_dirs: dict[str, Path]) -> None:
    r = load(srv, "pin1", lora_dirs["down2"], pinned=True)
    assert r.status_code == 200, r.text
    a = r.json()["adapter"]
    assert a["pinned"] is True and a["tier"] == "gpu" and a["slot"] is not None
    assert adapters(srv)["pool"]["pinned"] == 1
    assert unload(srv, "pin1").status_code == 200
    assert adapters(srv)["pool"]["pinned"] == 0


def test_pin_and_unpin_without_reload(srv: ServerThread, lora_dirs: dict[str, Path], client: openai.OpenAI,
                                      oracle: dict) -> None:
    assert load(srv, "pinme", lora_dirs["qv4"]).status_code == 200
    try:
        gen = by_name(adapters(srv))["pinme"]["generation"]
        r = requests.post(srv.url + "/v1/pin_lora_adapter", headers=ADMIN, json={"lora_name": "pinme", "pinned": True},
                          timeout=60)
        assert r.status_code == 200, r.text
        a = by_name(adapters(srv))["pinme"]
        assert a["pinned"] and a["tier"] == "gpu" and a["generation"] == gen  # same weights, no reload
        assert adapters(srv)["pool"]["pinned"] == 1
        # A second pin is refused at the limit (1 of 2 slots), and changes nothing.
        assert load(srv, "pinme2", lora_dirs["mlp6"]).status_code == 200
        before = adapters(srv)
        r = requests.post(srv.url + "/pin_lora_adapter", headers=ADMIN, json={"lora_name": "pinme2", "pinned": True},
                          timeout=60)
        assert r.status_code == 400 and "at most 1 of 2 GPU slots" in error_of(r)["message"]
        assert adapters(srv) == before
        r = requests.post(srv.url + "/pin_lora_adapter", headers=ADMIN, json={"lora_name": "pinme", "pinned": False},
                          timeout=60)
        assert r.status_code == 200 and not by_name(adapters(srv))["pinme"]["pinned"]
        assert adapters(srv)["pool"]["pinned"] == 0
        for body, status, needle in [({"lora_name": "nope", "pinned": True}, 404, "'nope' is not loaded"),
                                     ({"lora_name": "pinme", "pinned": "yes"}, 400, "'pinned' must be true or false"),
                                     ({"lora_name": "pinme"}, 400, "'pinned' must be true or false")]:
            r = requests.post(srv.url + "/pin_lora_adapter", headers=ADMIN, json=body, timeout=60)
            assert r.status_code == status and needle in error_of(r)["message"], r.text
        assert requests.post(srv.url + "/pin_lora_adapter", json={"lora_name": "pinme", "pinned": True},
                             timeout=60).status_code == 401
        assert_still_serving(srv, client, oracle)
    finally:
        unload(srv, "pinme")
        unload(srv, "pinme2")


def test_reload_pinned_adapter_in_place(srv: ServerThread, lora_dirs: dict[str, Path]) -> None:
    assert load(srv, "pinswap", lora_dirs["qv4"], pinned=True).status_code == 200
    try:
        r = load(srv, "pinswap", lora_dirs["mlp6"], pinned=True, load_inplace=True)
        assert r.status_code == 200, r.text
    finally:
        unload(srv, "pinswap")


# ---------------------------------------------------------------------------------- bad input

BAD_LOADS = [
    # (case, lora_name, path key or literal, extra, status, needle)
    ("rank above max", "bad", "rank16", {}, 400, "rank 16, above lora.max_lora_rank 8"),
    ("nonexistent path", "bad", "{root}/missing", {}, 400, "does not exist"),
    ("outside via ..", "bad", "{root}/../outside/qv4copy", {}, 400, "outside lora.adapter_roots"),
    ("outside via symlink", "bad", "{root}/link", {}, 400, "outside lora.adapter_roots"),
    ("truncated safetensors", "bad", "truncated", {}, 400, "corrupt or truncated safetensors"),
    (".bin only", "bad", "binonly", {}, 400, "pickle is never read"),
    ("DoRA", "bad", "dora", {}, 400, "DoRA"),
    ("duplicate name", "qv4", "mlp6", {}, 409, "already loaded"),
    ("name with ':'", "a:b", "mlp6", {}, 400, "invalid adapter name"),
    ("base model's name", MODEL, "mlp6", {}, 400, "base model's name"),
    ("not a directory", "bad", "{root}/qv4/adapter_config.json", {}, 400, "not a directory"),
    ("in-place of unknown", "bad", "mlp6", {"load_inplace": True}, 404, "not loaded"),
]


@pytest.mark.parametrize("case, name, path, extra, status, needle", BAD_LOADS, ids=[c[0] for c in BAD_LOADS])
def test_bad_load_changes_nothing(srv: ServerThread, client: openai.OpenAI, oracle: dict,
                                  lora_dirs: dict[str, Path], case: str, name: str, path: str, extra: dict,
                                  status: int, needle: str) -> None:
    before = adapters(srv)
    full = path.format(root=lora_dirs["root"]) if "{" in path else str(lora_dirs[path])
    r = load(srv, name, full, **extra)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert needle in err["message"], err
    assert adapters(srv) == before
    assert_still_serving(srv, client, oracle)


def test_pinning_beyond_the_limit_changes_nothing(srv: ServerThread, client: openai.OpenAI, oracle: dict,
                                                  lora_dirs: dict[str, Path]) -> None:
    assert load(srv, "pin1", lora_dirs["down2"], pinned=True).status_code == 200
    try:
        before = adapters(srv)
        r = load(srv, "pin2", lora_dirs["mlp6"], pinned=True)
        assert r.status_code == 400, r.text
        assert "at most 1 of 2 GPU slots may be pinned" in error_of(r)["message"]
        assert adapters(srv) == before
        assert_still_serving(srv, client, oracle)
    finally:
        assert unload(srv, "pin1").status_code == 200


@pytest.mark.parametrize("method, path, body, headers, status, needle", [
    ("post", "/unload_lora_adapter", {"lora_name": "nope"}, ADMIN, 404, "'nope' is not loaded"),
    ("post", "/v1/unload_lora_adapter", {"lora_name": "nope"}, ADMIN, 404, "'nope' is not loaded"),
    ("post", "/load_lora_adapter", {"lora_name": "x", "lora_path": "{qv4}"}, {}, 401, "Missing admin key"),
    ("post", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "{qv4}"},
     {"Authorization": "Bearer wrong"}, 401, "Incorrect admin key"),
    ("post", "/unload_lora_adapter", {"lora_name": "qv4"}, {}, 401, "Missing admin key"),
    ("get", "/v1/adapters", None, {"Authorization": "Bearer wrong"}, 401, "Incorrect admin key"),
    ("post", "/load_lora_adapter", {"lora_name": "x"}, ADMIN, 400, "Missing required field 'lora_path'"),
    ("post", "/load_lora_adapter", {"lora_name": "x", "lora_path": "{qv4}", "pin": True}, ADMIN, 400,
     "Unknown field(s) ['pin']"),
    ("post", "/load_lora_adapter", {"lora_name": "x", "lora_path": "{qv4}", "pinned": "yes"}, ADMIN, 400,
     "'pinned' must be a boolean"),
    ("post", "/load_lora_adapter", {"lora_name": "", "lora_path": "{qv4}"}, ADMIN, 400, "non-empty string"),
])
def test_bad_admin_request_changes_nothing(srv: ServerThread, client: openai.OpenAI, oracle: dict,
                                           lora_dirs: dict[str, Path], method: str, path: str,
                                           body: Optional[dict], headers: dict, status: int,
                                           needle: str) -> None:
    before = adapters(srv)
    if body is not None:
        body = {k: v.format(qv4=lora_dirs["qv4"]) if isinstance(v, str) else v for k, v in body.items()}
    r = requests.request(method, srv.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert needle in error_of(r)["message"]
    assert adapters(srv) == before
    assert_still_serving(srv, client, oracle)


def test_target_module_outside_lora_target_modules(lora_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    """A second small server that allows only q_proj and v_proj."""
    other = start_server(f"model.path={tiny_model_dir}", f"model.name={MODEL}", "model.max_model_len=128",
                         "model.device=cpu", "engine.num_kv_blocks=32", "lora.enabled=true",
                         "lora.max_lora_rank=8", "lora.target_modules=[q_proj,v_proj]",
                         f"lora.adapter_roots=[{lora_dirs['root']}]", "server.admin_key=secret")
    try:
        r = load(other, "mlp", lora_dirs["mlp6"])
        assert r.status_code == 400
        msg = error_of(r)["message"]
        assert "target module(s) ['gate_proj', 'up_proj'] not in lora.target_modules" in msg
        assert adapters(other)["data"] == [] and adapters(other)["cache"]["loads"] == 0
        assert requests.get(other.url + "/health", timeout=10).status_code == 200
        assert load(other, "qv", lora_dirs["qv4"]).status_code == 200
        assert generate(other, "Hello", "qv").status_code == 200
    finally:
        other.stop()


# ---------------------------------------------------------------------------------- LoRA or admin off

def test_admin_api_off_without_admin_key(tiny_server: ServerThread) -> None:
    """The conftest server: lora.enabled false, server.admin_key null."""
    for method, path in [("post", "/load_lora_adapter"), ("post", "/v1/unload_lora_adapter"),
                         ("get", "/v1/adapters")]:
        r = requests.request(method, tiny_server.url + path, headers=ADMIN, timeout=10,
                             json={"lora_name": "x", "lora_path": "/tmp"} if method == "post" else None)
        assert r.status_code == 403, r.text
        assert "server.admin_key is not set" in error_of(r)["message"]
    r = requests.post(tiny_server.url + "/v1/completions", json={"model": "x", "prompt": "a"}, timeout=10)
    assert r.status_code == 404 and "lora.enabled is false" in error_of(r)["message"]
    r = requests.post(tiny_server.url + "/generate", json={"text": ["a"], "lora_path": ["x"]}, timeout=10)
    assert r.status_code == 404 and error_of(r)["param"] == "lora_path"
    one_token = {"max_new_tokens": 1}
    r = requests.post(tiny_server.url + "/generate", timeout=10,
                      json={"text": "a", "lora_path": [None], "sampling_params": one_token})
    assert r.status_code == 400  # a single input takes a name, not a list
    r = requests.post(tiny_server.url + "/generate", timeout=10,
                      json={"text": "a", "lora_path": MODEL, "sampling_params": one_token})
    assert r.status_code == 200  # the base model's name is always valid
    cards = requests.get(tiny_server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in cards] == [MODEL]


def test_load_with_lora_disabled(tiny_model_dir: Path, lora_dirs: dict[str, Path]) -> None:
    other = start_server(f"model.path={tiny_model_dir}", f"model.name={MODEL}", "model.max_model_len=128",
                         "model.device=cpu", "engine.num_kv_blocks=32", "server.admin_key=secret")
    try:
        r = load(other, "qv", lora_dirs["qv4"])
        assert r.status_code == 400 and "lora.enabled is false" in error_of(r)["message"]
        assert error_of(unload(other, "qv"))["code"] == "lora_disabled"
        assert adapters(other) == {"object": "list", "enabled": False, "data": [], "retiring": [],
                                   "pool": None, "cache": None}
    finally:
        other.stop()
