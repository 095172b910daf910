"""Prefix caching in the engine on a tiny random Llama: greedy tokens with the cache on equal those
with it off and peft's, for base and mixed-adapter batches; adapters, reloads and cache_salt never
share blocks they must not; preemption and aborts leak no block; the hit counters move."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from tests.conftest import default_config
from tests.engine.test_static_decode import uncaptured_static_decode
from tests.lora.test_lora_engine import make_adapter, peft_greedy

NEW = 6
SYSTEM = list(range(200, 240))  # 40 tokens: 2 full blocks of 16 shared, 8 more in the third
USERS = [[300 + i, 301 + i, 302 + i, 7 * i + 1] for i in range(4)]
PROMPTS = [SYSTEM + u for u in USERS]  # 44 tokens each
KV = ("all-linear", "k and v under LoRA: the same tokens have other K/V per adapter")


def greedy(salt: Optional[str] = None, new: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, cache_salt=salt)


def make(model_dir: Path, root: Path, caching: bool, *overrides: str) -> LLMEngine:
    return LLMEngine(default_config(f"model.path={model_dir}", "model.device=cpu", "model.max_model_len=256",
                                    "engine.kv_block_size=16", "engine.num_kv_blocks=64",
                                    f"engine.enable_prefix_caching={str(caching).lower()}", "lora.enabled=true",
                                    "lora.max_lora_rank=8", "lora.max_loras_per_batch=3",
                                    f"lora.adapter_roots=[{root}]", *overrides))


def run(engine: LLMEngine, jobs: list[tuple[Optional[str], list[int], SamplingParams]]) -> list[list[int]]:
    """Submit the jobs at once and run them to the end; their tokens, in job order."""
    base = len(engine.seqs)
    for j, (adapter, prompt, params) in enumerate(jobs):
        engine.add_request(f"j{base}-{j}", prompt, params, adapter=adapter)
    res: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            res.setdefault(o.request_id, []).extend(o.token_ids)
    assert engine.block_manager.num_used == 0
    return [res[f"j{base}-{j}"] for j in range(len(jobs))]


def hits(engine: LLMEngine) -> list[int]:
    """Cached tokens per admission since the last call."""
    return [h for _, _, h in engine.stats.take().prefix_cache_lookups]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    return {name: make_adapter(tiny_model_dir, root / name, seed=10 + i, r=8, lora_alpha=16,
                               target_modules=KV[0]) for i, name in enumerate(("a", "b"))}


@pytest.fixture(scope="module")
def oracle(adapters: dict[str, Path], tiny_model_dir: Path) -> dict[Optional[str], list[list[int]]]:
    out: dict[Optional[str], list[list[int]]] = {n: peft_greedy(tiny_model_dir, p, PROMPTS, NEW)[0]
                                                 for n, p in adapters.items()}
    out[None] = peft_greedy(tiny_model_dir, None, PROMPTS, NEW)[0]
    return out


@pytest.fixture(scope="module")
def engines(adapters: dict[str, Path], tiny_model_dir: Path) -> dict[bool, LLMEngine]:
    out = {}
    for caching in (True, False):
        eng = make(tiny_model_dir, adapters["a"].parent, caching)
        for name, path in adapters.items():
            eng.lora.load(name, str(path))  # type: ignore[union-attr]
        out[caching] = eng
    return out


def mixed(wave: list[int]) -> list[tuple[Optional[str], list[int], SamplingParams]]:
    return [(name, PROMPTS[p], greedy()) for p in wave for name in (None, "a", "b")]


def test_cache_on_equals_cache_off_and_peft_for_base_and_mixed_adapters(engines: dict[bool, LLMEngine],
                                                                      oracle: dict) -> None:
    got = {}
    for caching, eng in engines.items():
        eng.stats.take()
        # Two waves: the second finds the first's system prompt cached, per adapter.
        got[caching] = run(eng, mixed([0, 1])) + run(eng, mixed([2, 3]))
        # The second wave's system prompt: 2 full blocks cached, under each adapter and the base.
        assert hits(eng) == ([0] * 6 + [32] * 6 if caching else [])
    assert got[True] == got[False]
    want = [oracle[name][p][:NEW] for p in range(4) for name in (None, "a", "b")]
    assert got[True] == want


def test_same_prompt_under_two_adapters_never_shares_a_block(adapters: dict[str, Path], oracle: dict,
                                                             tiny_model_dir: Path) -> None:
    eng = make(tiny_model_dir, adapters["a"].parent, True)
    for name, path in adapters.items():
        eng.lora.load(name, str(path))  # type: ignore[union-attr]
    assert run(eng, [("a", PROMPTS[0], greedy())]) == [oracle["a"][0]]
    eng.add_request("b-only", PROMPTS[0], greedy(), adapter="b")
    eng.add_request("a-again", PROMPTS[0], greedy(), adapter="a")
    eng.step()  # both admitted: a takes its cached blocks, b computes its own
    b, a = eng.seqs["b-only"], eng.seqs["a-again"]
    assert not set(a.block_table) & set(b.block_table)
    assert a.num_computed_tokens == 44 and b.num_computed_tokens == 44
    while eng.has_unfinished():
        eng.step()
    assert [b.output_token_ids, a.output_token_ids] == [oracle["b"][0], oracle["a"][0]]
    assert hits(eng) == [0, 0, 32]  # b found nothing of a's


def test_inplace_reload_between_identical_requests_serves_the_new_weights(
        adapters: dict[str, Path], oracle: dict, tiny_model_dir: Path) -> None:
    eng = make(tiny_model_dir, adapters["a"].parent, True)
    eng.lora.load("x", str(adapters["a"]))  # type: ignore[union-attr]
    assert run(eng, [("x", PROMPTS[1], greedy())]) == [oracle["a"][1]]
    assert eng.block_manager.num_cached == 3  # 44 prompt + 5 fed-back tokens: 3 full blocks
    eng.lora.load("x", str(adapters["b"]), inplace=True)  # type: ignore[union-attr]
    assert eng.block_manager.num_cached == 0  # the old weights' blocks were dropped
    eng.stats.take()
    assert run(eng, [("x", PROMPTS[1], greedy())]) == [oracle["b"][1]]
    assert hits(eng) == [0]
    eng.lora.unload("x")  # type: ignore[union-attr]
    assert eng.block_manager.num_cached == 0 and eng.block_manager.num_free == 64


def test_cache_salt_shares_only_within_one_salt(engines: dict[bool, LLMEngine], oracle: dict) -> None:
    eng = engines[True]
    prompt = [5] * 16 + PROMPTS[2]  # a prefix no other test caches
    want = run(engines[False], [(None, prompt, greedy())])
    eng.stats.take()
    for salt in ("t1", "t2", None, "t1"):
        assert run(eng, [(None, prompt, greedy(salt))]) == want
    assert hits(eng) == [0, 0, 0, 48]


def test_preemption_and_aborts_leak_no_block(adapters: dict[str, Path], tiny_model_dir: Path) -> None:
    """A soak on a small cache: shared prefixes, three adapters, preemptions, random aborts. Greedy
    tokens of the requests that finish equal those of the cache-off engine; every block comes back."""
    rng = random.Random(0)
    jobs = []
    for i in range(24):
        prompt = (SYSTEM[:rng.choice([16, 32, 40])] if rng.random() < 0.7 else [400 + i] * 20) + USERS[i % 4]
        jobs.append((rng.choice([None, "a", "b"]), prompt, greedy(new=rng.randint(2, 10))))
    out = {}
    for caching in (True, False):
        eng = make(tiny_model_dir, adapters["a"].parent, caching, "engine.num_kv_blocks=12",
                   "engine.max_num_batched_tokens=64")
        for name, path in adapters.items():
            eng.lora.load(name, str(path))  # type: ignore[union-attr]
        for j, (adapter, prompt, params) in enumerate(jobs):
            eng.add_request(f"r{j}", prompt, params, adapter=adapter)
        res: dict[str, list[int]] = {}
        steps = 0
        while eng.has_unfinished():
            for o in eng.step():
                res.setdefault(o.request_id, []).extend(o.token_ids)
            steps += 1
            if caching and steps % 7 == 0 and eng.seqs:
                eng.abort(rng.choice(sorted(eng.seqs)))
        bm = eng.block_manager
        assert bm.num_used == 0 and sum(bm._refs) == 0
        assert bm.num_free == 12 and bm.num_cached <= 12
        if caching:
            assert eng.scheduler.num_preemptions > 0 and any(hits(eng))
        out[caching] = res
    for rid, toks in out[True].items():
        want = out[False][rid]
        assert toks == want[:len(toks)]


def test_async_scheduling_with_the_cache(tiny_model_dir: Path, engines: dict[bool, LLMEngine]) -> None:
    """Decode steps over the static buffers (async scheduling; base requests: the uncaptured static
    step on cpu runs no LoRA): a block whose last token was still on the device is cached once that
    token is read; tokens equal the eager cache-off engine's."""
    jobs = [(None, p, greedy()) for p in PROMPTS]
    want = run(engines[False], jobs)
    eng = LLMEngine(default_config(f"model.path={tiny_model_dir}", "model.device=cpu", "model.max_model_len=256",
                                   "engine.num_kv_blocks=64", "engine.async_scheduling=true"))
    uncaptured_static_decode(eng)
    eng.stats.take()
    first = run(eng, [(None, PROMPTS[0], greedy(new=30))])  # its replies fill a block
    assert run(eng, jobs) == want
    assert hits(eng) == [0, 32, 32, 32, 32]
    follow = PROMPTS[0] + first[0][:24]  # a follow-up turn: the block the reply filled (48-63) hits too
    run(eng, [(None, follow, greedy())])
    assert hits(eng) == [64]
