"""Load on first request against moto's S3 API server: 50 concurrent first requests for a new adapter
cause one download and all give peft's tokens; 1,000 requests for random unknown names cost the store
no more lookups than lora.resolver.max_misses; malicious names are refused with nothing fetched."""

from __future__ import annotations

import random
import string
from concurrent.futures import ThreadPoolExecutor
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
TEMPLATE = f"s3://{BUCKET}/team/lazy/{{name}}"
MAX_MISSES = 16


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, s3) -> tuple[Path, list[int]]:
    """An adapter uploaded under the resolver's template as `fresh`; and peft's greedy tokens for it."""
    d = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lazy") / "fresh", seed=31, **ADAPTERS["qv4"])
    upload(s3, d, "team/lazy/fresh")
    ids = Tokenizer(tiny_model_dir).encode(PROMPTS[0])
    return d, peft_greedy(tiny_model_dir, d, [ids])[0][0]


@pytest.fixture(scope="module")
def srv(fresh, tiny_model_dir: Path, s3_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("resolver-serve")
    cfg = compose_config(config_tree(tmp / "configs", "adapters: {}\n"), [
        "server.host=127.0.0.1", "server.port=0", f"model.path={tiny_model_dir}", "model.name=tiny",
        "model.device=cpu", "model.max_model_len=256", "engine.num_kv_blocks=128", "lora.enabled=true",
        "lora.max_lora_rank=8", "lora.max_loras_per_batch=2", "lora.max_loaded_loras=2",
        f"lora.allowed_sources=[s3://{BUCKET}/team]", f"lora.s3_endpoint_url={s3_url}", "lora.s3_region=us-east-1",
        f"lora.adapter_cache_dir={tmp / 'cache'}", f"lora.resolver.sources=['{TEMPLATE}']",
        f"lora.resolver.max_misses={MAX_MISSES}", "server.admin_key=adm", "reconcile.watch=false"])
    server = ServerThread(cfg).start()
    yield server
    server.stop()


@pytest.fixture
def store_calls(srv: ServerThread) -> Iterator[list[str]]:
    """Every S3 call the server makes from now on (botocore's before-call event on its own client)."""
    calls: list[str] = []
    events = srv.engine.engine.lora.sources.fetcher("s3").client.meta.events

    def count(model, **_) -> None:
        calls.append(model.name)

    events.register("before-call.s3", count)
    yield calls
    events.unregister("before-call.s3", count)


def listed(srv: ServerThread) -> dict[str, dict]:
    r = requests.get(srv.url + "/v1/adapters", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return {a["name"]: a for a in r.json()["data"]}


def test_concurrent_first_requests_share_one_download_and_match_peft(srv: ServerThread, fresh, store_calls,
                                                                      tiny_model_dir: Path) -> None:
    assert "fresh" not in listed(srv)
    cache = srv.engine.engine.lora.sources.cache
    before = cache.downloads
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    want = Tokenizer(tiny_model_dir).decode(fresh[1])

    def ask(i: int) -> str:
        model = "fresh" if i % 2 else "tiny:fresh"  # both ways of naming an adapter resolve
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                        extra_body={"ignore_eos": True})
        return out.choices[0].text

    with ThreadPoolExecutor(50) as pool:
        texts = list(pool.map(ask, range(50)))
    assert texts == [want] * 50
    assert cache.downloads - before == 1
    assert store_calls.count("GetObject") == 2  # the adapter's two files, once
    entry = listed(srv)["fresh"]
    assert entry["path"] == TEMPLATE.format(name="fresh") and entry["managed"] is False and not entry["pinned"]


def test_random_unknown_names_are_bounded_by_the_miss_cache(srv: ServerThread, store_calls) -> None:
    rng = random.Random(1)
    names = ["".join(rng.choices(string.ascii_lowercase + string.digits, k=16)) for _ in range(1000)]
    before = dict(listed(srv))

    def ask(name: str) -> int:
        return requests.post(srv.url + "/v1/completions", timeout=60,
                             json={"model": name, "prompt": "x", "max_tokens": 1}).status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(ask, names))
    assert set(statuses) <= {404, 429} and statuses.count(404) >= 1, sorted(set(statuses))
    # Each lookup is one HEAD of adapter_config.json (missing: the next file is not asked for).
    assert 1 <= len(store_calls) <= MAX_MISSES, len(store_calls)
    assert set(store_calls) == {"HeadObject"} and statuses.count(404) <= MAX_MISSES
    assert listed(srv) == before


@pytest.mark.parametrize("field, name, status", [
    ("model", "../team/lazy/fresh", 400), ("model", "fresh/../../x", 400), ("model", "fresh?versionId=1", 400),
    ("model", "fr%2Fesh", 400), ("model", "fresh\r\nX-Injected", 400), ("lora_path", "../fresh", 400),
    ("model", "tiny:../fresh", 400),
    # ':' separates base and adapter: a URI names base 's3', which is not served here.
    ("model", "s3://adapters/team/lazy/fresh", 404),
])
def test_malicious_names_are_refused_with_nothing_fetched(srv: ServerThread, store_calls, field: str,
                                                          name: str, status: int) -> None:
    before = listed(srv)
    if field == "model":
        r = requests.post(srv.url + "/v1/completions", timeout=60, json={"model": name, "prompt": "x", "max_tokens": 1})
    else:
        r = requests.post(srv.url + "/generate", timeout=60, json={"text": "x", "lora_path": name})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field
    if status == 400:
        assert err["code"] == "invalid_model_name" and "cannot be looked up" in err["message"], err
    assert store_calls == [] and listed(srv) == before
    assert SECRET_KEY not in r.text and ACCESS_KEY not in r.text


def test_a_template_outside_the_allowlist_is_a_config_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    from appliance.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"lora\.resolver\.sources\[0\]: .*not under lora\.allowed_sources"):
        compose_config(config_tree(tmp_path / "configs", "adapters: {}\n"), [
            f"model.path={tiny_model_dir}", "lora.enabled=true", "lora.allowed_sources=[s3://adapters/team]",
            "lora.resolver.sources=['s3://adapters/other/{name}']"])
