"""cache_salt over HTTP with the official `openai` client and /generate: a repeated prompt is served
from the prefix cache only within one salt (the hit counters on /metrics say so), the tokens never
change, and a bad salt is a 400 in OpenAI's error shape that changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import openai
import pytest
import requests

from tests.server.conftest import ServerThread, start_server
from tests.server.test_openai_api import assert_error_shape
from tests.telemetry.helpers import scrape

PROMPT = list(range(500, 540))  # 40 tokens: 2 full blocks of 16 are cacheable


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path) -> Iterator[ServerThread]:
    s = start_server(f"model.path={tiny_model_dir}", "model.name=tiny", "model.device=cpu")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def counters(srv: ServerThread) -> tuple[float, float]:
    s = scrape(srv)
    return (s.get("appliance_prefix_cache_queries_total", adapter="base"),
            s.get("appliance_prefix_cache_hits_total", adapter="base"))


def complete(client: openai.OpenAI, salt: Optional[str]) -> list[int]:
    extra = {} if salt is None else {"cache_salt": salt}
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                    extra_body=extra)
    return out.choices[0].logprobs.tokens


def test_cache_salt_separates_the_prefix_cache(srv: ServerThread, client: openai.OpenAI) -> None:
    seen = []
    for salt in (None, None, "tenant-1", "tenant-2", "tenant-1"):
        before = counters(srv)
        seen.append(complete(client, salt))
        after = counters(srv)
        assert after[0] - before[0] == len(PROMPT)
        seen[-1] = (seen[-1], after[1] - before[1])
    assert [h for _, h in seen] == [0, 32, 0, 0, 32]
    assert len({tuple(t) for t, _ in seen}) == 1
    before = counters(srv)
    r = requests.post(srv.url + "/generate", timeout=120, json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "cache_salt": "tenant-2"}})
    assert r.status_code == 200, r.text
    assert counters(srv)[1] - before[1] == 32
    blocks = scrape(srv).get("appliance_prefix_cache_blocks")
    assert blocks >= 6  # one 2-block prefix per salt (none, tenant-1, tenant-2), idle until evicted


@pytest.mark.parametrize("salt", ["", 7, "x" * 257])
def test_bad_cache_salt_is_refused(srv: ServerThread, client: openai.OpenAI, salt: object) -> None:
    before = counters(srv)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"cache_salt": salt})
    body = e.value.response.json()
    assert_error_shape(body)
    assert "cache_salt" in body["error"]["message"] + str(body["error"].get("param"))
    r = requests.post(srv.url + "/generate", timeout=30,
                      json={"input_ids": PROMPT, "sampling_params": {"cache_salt": salt}})
    assert r.status_code == 400 and "cache_salt" in r.text
    assert counters(srv) == before
