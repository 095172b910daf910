"""Adapters from s3:// served end to end: one listed in adapters/*.yaml and one loaded through the
admin API, both from moto's S3 API server, give peft's greedy tokens; bad remote paths get a clean
400 and change nothing; a cache bound of one adapter makes cold reads fetch evicted ones again; no
response names the AWS credentials."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import openai
import pytest
import requests

from appliance.config.compose import compose_config
from appliance.engine.tokenizer import Tokenizer
from tests.conftest import config_tree
from tests.lora.sources.conftest import ACCESS_KEY, BUCKET, SECRET_KEY, upload
from tests.lora.test_lora_engine import ADAPTERS, NEW, PROMPTS, make_adapter, peft_greedy
from tests.server.conftest import ServerThread

ADMIN = {"Authorization": "Bearer adm"}
NAMES = ("qv4", "mlp6")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, s3) -> dict[str, tuple[Path, str]]:
    """name -> (the local dir peft wrote, its s3:// URI)."""
    root = tmp_path_factory.mktemp("s3-adapters")
    out = {}
    for i, name in enumerate(NAMES):
        d = make_adapter(tiny_model_dir, root / name, seed=20 + i, **ADAPTERS[name])
        out[name] = (d, upload(s3, d, f"team/{name}"))
    return out


@pytest.fixture(scope="module")
def oracle(made: dict, tiny_model_dir: Path) -> dict[str, list[int]]:
    ids = Tokenizer(tiny_model_dir).encode(PROMPTS[0])
    return {name: peft_greedy(tiny_model_dir, made[name][0], [ids])[0][0] for name in NAMES}


@pytest.fixture(scope="module")
def srv(made: dict, tiny_model_dir: Path, s3_url: str, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[ServerThread]:
    """The tiny model with one slot and one CPU-tier entry (every switch of adapter is a cold read),
    a disk cache with room for one adapter, and `fromyaml` listed in the config by its s3:// URI."""
    tmp = tmp_path_factory.mktemp("s3-serve")
    biggest = max(sum(f.stat().st_size for f in d.iterdir()) for d, _ in made.values()) + 200
    tree = config_tree(tmp / "configs", f"adapters:\n  fromyaml:\n    path: {made['qv4'][1]}\n    rank: 4\n")
    cfg = compose_config(tree, [
        "server.host=127.0.0.1", "server.port=0", f"model.path={tiny_model_dir}", "model.name=tiny",
        "model.device=cpu", "model.max_model_len=256", "engine.num_kv_blocks=64", "lora.enabled=true",
        "lora.max_lora_rank=8", "lora.max_loras_per_batch=1", "lora.max_loaded_loras=1",
        f"lora.allowed_sources=[s3://{BUCKET}/team]", f"lora.s3_endpoint_url={s3_url}", "lora.s3_region=us-east-1",
        f"lora.adapter_cache_dir={tmp / 'cache'}", f"lora.adapter_cache_bytes={biggest}",
        f"lora.max_adapter_bytes={biggest}", "server.admin_key=adm", "reconcile.watch=false"])
    server = ServerThread(cfg).start()
    yield server
    server.stop()


def load(srv: ServerThread, name: str, path: str) -> requests.Response:
    return requests.post(srv.url + "/load_lora_adapter", headers=ADMIN, timeout=120,
                         json={"lora_name": name, "lora_path": path})


def listed(srv: ServerThread) -> dict[str, dict]:
    r = requests.get(srv.url + "/v1/adapters", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    assert SECRET_KEY not in r.text and ACCESS_KEY not in r.text
    return {a["name"]: a for a in r.json()["data"]}


def tokens(srv: ServerThread, model: str) -> list[int]:
    r = requests.post(srv.url + "/generate", timeout=120, json={
        "text": PROMPTS[0], "lora_path": model,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_yaml_and_admin_adapters_from_s3_match_peft(srv: ServerThread, made: dict, oracle: dict,
                                                    tiny_model_dir: Path) -> None:
    assert listed(srv)["fromyaml"]["path"] == made["qv4"][1]  # the registry shows the URI
    r = load(srv, "fromapi", made["mlp6"][1])
    assert r.status_code == 200, r.text
    assert listed(srv)["fromapi"]["path"] == made["mlp6"][1]
    # One CPU entry and a disk cache for one adapter: fromapi's download evicted fromyaml's entry.
    assert listed(srv)["fromyaml"]["tier"] == "remote"
    metrics = requests.get(srv.url + "/metrics", timeout=30).text
    assert 'appliance_lora_adapters{tier="remote"} 1.0' in metrics
    downloads = re.search(r'appliance_lora_load_duration_seconds_count\{tier="disk"\} (\S+)', metrics)
    assert downloads is not None and float(downloads.group(1)) == 2  # fromyaml at start, fromapi now
    assert oracle["qv4"] != oracle["mlp6"]  # else the comparison below could not tell them apart
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tok = Tokenizer(tiny_model_dir)
    # One slot, one CPU entry and a disk cache for one adapter: each switch is a cold read whose
    # cache entry the other's fetch evicted, so it is fetched from S3 again, checksum-checked, served.
    for _ in range(2):
        for name, want in (("fromyaml", "qv4"), ("fromapi", "mlp6")):
            out = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == tok.decode(oracle[want]), name
            assert tokens(srv, name) == oracle[want], name
    cache = Path(srv.cfg.lora.adapter_cache_dir)
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1  # the bound holds


@pytest.mark.parametrize("path, message", [
    ("s3://adapters/elsewhere/qv4", "not under lora.allowed_sources"),
    ("s3://adapters/team/../elsewhere", "'..'"),
    ("s3://adapters/team/deleted", "adapter_model.safetensors does not exist"),
    ("s3://adapters/team/not-peft", "s3://adapters/team/not-peft/adapter_config.json: peft_type 'IA3' is not supported"),
])
def test_bad_remote_paths_are_refused_and_change_nothing(srv: ServerThread, made: dict, s3, path: str,
                                                         message: str) -> None:
    d = made["qv4"][0]
    upload(s3, d, "elsewhere/qv4")
    upload(s3, d, "team/deleted")
    s3.delete_object(Bucket=BUCKET, Key="team/deleted/adapter_model.safetensors")
    s3.put_object(Bucket=BUCKET, Key="team/not-peft/adapter_config.json", Body=b'{"peft_type": "IA3"}')
    s3.put_object(Bucket=BUCKET, Key="team/not-peft/adapter_model.safetensors",
                  Body=(d / "adapter_model.safetensors").read_bytes())
    before = listed(srv)
    r = load(srv, "bad", path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == "lora_path"
    assert message in err["message"], err["message"]
    assert SECRET_KEY not in r.text and ACCESS_KEY not in r.text
    assert listed(srv) == before
    status = requests.get(srv.url + "/v1/status", headers=ADMIN, timeout=30).text
    assert SECRET_KEY not in status and ACCESS_KEY not in status


def test_yaml_path_outside_the_allowlist_is_a_config_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    from appliance.config.schema import ConfigError

    tree = config_tree(tmp_path / "configs", "adapters:\n  x:\n    path: s3://adapters/secret-team/x\n")
    with pytest.raises(ConfigError, match=r"^config.yaml: adapters.x.path: s3://adapters/secret-team/x: refused: "
                                          r"not under lora.allowed_sources"):
        compose_config(tree, [f"model.path={tiny_model_dir}", "lora.enabled=true",
                              "lora.allowed_sources=[s3://adapters/team]"])


def test_plan_sees_a_changed_object_as_new_weights(tmp_path: Path, tiny_model_dir: Path, made: dict, s3,
                                                   s3_url: str) -> None:
    """The reconciler's desired state fetches the current revision: the URI is the path (stable), and
    an object replaced in S3 shows as a new checksum, which plan renders as `-/+ reload`."""
    from appliance.reconcile.live import desired_state
    from appliance.reconcile.plan import plan, render

    uri = upload(s3, made["qv4"][0], "team/moving")
    tree = config_tree(tmp_path / "configs", f"adapters:\n  moving:\n    path: {uri}\n")
    cfg = compose_config(tree, [f"model.path={tiny_model_dir}", "lora.enabled=true", "lora.max_lora_rank=8",
                                f"lora.allowed_sources=[s3://{BUCKET}/team]", f"lora.s3_endpoint_url={s3_url}",
                                "lora.s3_region=us-east-1", f"lora.adapter_cache_dir={tmp_path / 'cache'}"])
    before, broken = desired_state(cfg)
    assert broken == {} and before["moving"].path == uri
    s3.put_object(Bucket=BUCKET, Key="team/moving/adapter_model.safetensors",
                  Body=(made["mlp6"][0] / "adapter_model.safetensors").read_bytes())
    s3.put_object(Bucket=BUCKET, Key="team/moving/adapter_config.json",
                  Body=(made["mlp6"][0] / "adapter_config.json").read_bytes())
    after, broken = desired_state(cfg)
    assert broken == {} and after["moving"].path == uri and after["moving"].checksum != before["moving"].checksum
    assert render(plan(after, before)).startswith("-/+ moving: reload (weights changed: checksum")
    s3.delete_object(Bucket=BUCKET, Key="team/moving/adapter_config.json")
    _, broken = desired_state(cfg)
    assert "s3://adapters/team/moving/adapter_config.json does not exist" in broken["moving"]


def test_concurrent_admin_loads_of_one_uri_download_once(srv: ServerThread, made: dict, s3, oracle: dict) -> None:
    from concurrent.futures import ThreadPoolExecutor

    uri = upload(s3, made["mlp6"][0], "team/concurrent")
    cache = srv.engine.engine.lora.sources.cache
    before = cache.downloads
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: load(srv, f"conc{i}", uri), range(6)))
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert cache.downloads - before == 1
    assert tokens(srv, "conc3") == oracle["mlp6"]


def test_changed_object_shows_its_revision_in_plan_and_reloads_on_apply(srv: ServerThread, made: dict, s3,
                                                                        oracle: dict, s3_url: str, tmp_path: Path,
                                                                        tiny_model_dir: Path) -> None:
    """`appliance plan`/`apply`'s code against the live server: a remote adapter is planned with its
    ETag revision; replacing the object in S3 shows as `-/+ reload` naming both revisions, apply
    reloads it, it then gives the new adapter's tokens, and the next plan has nothing to do."""
    import asyncio

    from appliance.reconcile.apply import execute
    from appliance.reconcile.client import AdminClient
    from appliance.reconcile.live import desired_state, live_adapters
    from appliance.reconcile.plan import plan, render

    uri = upload(s3, made["qv4"][0], "team/applied")
    tree = config_tree(tmp_path / "configs", f"adapters:\n  applied:\n    path: {uri}\n")
    cfg = compose_config(tree, [f"model.path={tiny_model_dir}", "lora.enabled=true", "lora.max_lora_rank=8",
                                f"lora.allowed_sources=[s3://{BUCKET}/team]", f"lora.s3_endpoint_url={s3_url}",
                                "lora.s3_region=us-east-1", f"lora.adapter_cache_dir={tmp_path / 'cache'}"])
    client = AdminClient(srv.url, "adm")

    def planned():
        desired, broken = desired_state(cfg)
        assert broken == {}
        p = plan(desired, {n: a for n, a in live_adapters(client.adapters()).items() if n == "applied"})
        return desired["applied"].revision, p

    rev1, p = planned()
    assert rev1.startswith("etag:") and render(p).startswith(f"+ applied: load (not loaded ({uri} at {rev1}))")
    assert all(r.ok for r in asyncio.run(execute(p.actions, client)))
    assert tokens(srv, "applied") == oracle["qv4"] and listed(srv)["applied"]["revision"] == rev1
    for f in made["mlp6"][0].iterdir():
        if f.is_file():
            s3.put_object(Bucket=BUCKET, Key=f"team/applied/{f.name}", Body=f.read_bytes())
    rev2, p = planned()
    assert rev2 != rev1
    assert render(p).startswith("-/+ applied: reload (weights changed: checksum ") and \
        f"; revision {rev1} -> {rev2})" in render(p)
    assert all(r.ok for r in asyncio.run(execute(p.actions, client)))
    assert tokens(srv, "applied") == oracle["mlp6"] and listed(srv)["applied"]["revision"] == rev2
    assert planned()[1].actions == []
