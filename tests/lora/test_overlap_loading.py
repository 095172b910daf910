"""Overlap loading (lora.overlap_loading) on the real engine: tiny random Llama, real PEFT adapters.

A cold adapter (evicted from the CPU tier) is read by a background thread; the read is made slow the
way a slow disk would (debug.fault_injection_read_delay_s sleeps, then the real read runs). While it is
in flight, the other requests keep generating; the waiting request then produces exactly the tokens the
engine without overlap produces; a failed read fails only its requests; unload and in-place reload
during the read stay correct; nothing is dropped.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.request import AdapterNotFoundError, RequestOutput, SamplingParams
from tests.lora.test_lora_engine import PROMPTS, lora_engine, make_adapter

DELAY = "2.0"  # seconds each cold read sleeps: many tiny-model steps fit in it, even on a loaded CPU
LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ov_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ov_adapters")
    kws = {"x": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
           "y": dict(r=8, lora_alpha=16, target_modules="all-linear"),
           "z": dict(r=2, lora_alpha=4, target_modules=["down_proj"]),
           "w": dict(r=6, lora_alpha=12, target_modules=["gate_proj", "up_proj", "o_proj"])}
    return {n: make_adapter(tiny_model_dir, root / n, seed=10 + i, **kw) for i, (n, kw) in enumerate(kws.items())}


def overlap_engine(model_dir: Path, adapters: dict[str, Path], *extra: str) -> LLMEngine:
    """Overlap on, a CPU tier of 2: loading x, y, z in that order leaves x on disk only (cold)."""
    root = next(iter(adapters.values())).parent
    engine = lora_engine(model_dir, root, "lora.overlap_loading=true", "lora.max_loaded_loras=2",
                         "lora.max_loras_per_batch=2", f"debug.fault_injection_read_delay_s={DELAY}", *extra)
    for n in ("x", "y", "z"):
        engine.lora.load(n, str(adapters[n]))
    assert engine.lora.tier("x") == "disk" and engine.lora.tier("z") == "cpu"
    return engine


def reference(model_dir: Path, adapters: dict[str, Path], name: str, prompt: int, params: SamplingParams) -> list[int]:
    """The same request alone on an engine without overlap loading (weights read inline)."""
    root = next(iter(adapters.values())).parent
    engine = lora_engine(model_dir, root)
    engine.lora.load(name, str(adapters[name]))
    engine.add_request("ref", engine.tokenizer.encode(PROMPTS[prompt]), params, adapter=name)
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.token_ids
    return out


def drain(engine: LLMEngine, res: dict[str, list[int]], done: dict[str, RequestOutput]) -> None:
    while engine.has_unfinished():
        collect(engine.step(), res, done)
    assert engine.block_manager.num_used == 0


def collect(outs: list[RequestOutput], res: dict[str, list[int]], done: dict[str, RequestOutput]) -> None:
    for o in outs:
        res.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finished:
            done[o.request_id] = o


def test_cold_read_runs_beside_the_batch_and_gives_the_same_tokens(ov_adapters: dict[str, Path],
                                                                   tiny_model_dir: Path) -> None:
    engine = overlap_engine(tiny_model_dir, ov_adapters)
    enc = engine.tokenizer.encode
    engine.add_request("base", enc(PROMPTS[0]), LONG)
    engine.add_request("warm", enc(PROMPTS[1]), LONG, adapter="z")  # in host memory: runs at once
    res: dict[str, list[int]] = {}
    done: dict[str, RequestOutput] = {}
    for _ in range(2):  # past the first steps' one-off costs
        collect(engine.step(), res, done)
    key = engine.lora.resolve("x")
    engine.add_request("cold", enc(PROMPTS[2]), SHORT, adapter="x")
    collect(engine.step(), res, done)  # the scheduler asks for x: its read starts
    during = steps = 0
    saw_load_wait = False
    while engine.lora.reader.busy(key):
        assert not res.get("cold"), "the cold request ran before its weights were read"
        saw_load_wait |= engine.scheduler.waiting_by_reason()["load"] == 1
        before = {k: len(res.get(k, [])) for k in ("base", "warm")}
        collect(engine.step(), res, done)
        if engine.lora.reader.busy(key):  # this whole step ran while the read was in flight
            steps += 1
            during += sum(len(res.get(k, [])) - n for k, n in before.items())
    # The batch kept generating while the read ran (it would pause for the whole read without overlap).
    assert saw_load_wait and steps > 0 and during > 0, (steps, during)
    assert engine.lora.tier("x") in ("cpu", "gpu")  # read into the CPU tier (and on to a slot)
    drain(engine, res, done)
    assert {k: o.finish_reason for k, o in done.items()} == {"base": "length", "warm": "length", "cold": "length"}
    assert res["cold"] == reference(tiny_model_dir, ov_adapters, "x", 2, SHORT)
    assert len(res["base"]) == len(res["warm"]) == LONG.max_tokens
    ev = engine.stats.take()
    assert [(ld.tier, ld.ok) for ld in ev.loads if ld.tier == "cpu"][-1] == ("cpu", True)
    assert max(ld.duration_s for ld in ev.loads if ld.tier == "cpu") >= float(DELAY)  # the read's own time


def test_failed_background_read_fails_only_its_requests(ov_adapters: dict[str, Path], tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    for n in ("x", "y", "z"):
        shutil.copytree(ov_adapters[n], root / n)
    engine = overlap_engine(tiny_model_dir, {n: root / n for n in ("x", "y", "z")})
    wfile = root / "x" / "adapter_model.safetensors"
    good = wfile.read_bytes()
    wfile.write_bytes(good[: len(good) // 2])  # truncated on disk after it was registered
    enc = engine.tokenizer.encode
    engine.add_request("base", enc(PROMPTS[0]), SHORT)
    engine.add_request("cold1", enc(PROMPTS[1]), SHORT, adapter="x")
    engine.add_request("cold2", enc(PROMPTS[2]), SHORT, adapter="x")
    engine.add_request("warm", enc(PROMPTS[3]), SHORT, adapter="z")
    res: dict[str, list[int]] = {}
    done: dict[str, RequestOutput] = {}
    drain(engine, res, done)
    assert {k: o.finish_reason for k, o in done.items()} == {"base": "length", "warm": "length",
                                                            "cold1": "error", "cold2": "error"}
    assert "adapter 'x' could not be loaded" in done["cold1"].error and "changed on disk" in done["cold1"].error
    assert not res.get("cold1") and not res.get("cold2")
    assert engine.lora.pool.lookup(engine.lora.resolve("x")) is None  # no slot kept for it
    assert [ld.ok for ld in engine.stats.take().loads if ld.tier == "cpu"][-1] is False
    # The file is repaired: the next request reads it again and runs.
    wfile.write_bytes(good)
    engine.add_request("again", enc(PROMPTS[1]), SHORT, adapter="x")
    drain(engine, res, done)
    assert done["again"].finish_reason == "length"
    assert res["again"] == reference(tiny_model_dir, ov_adapters, "x", 1, SHORT)


def test_unload_and_reload_in_place_while_a_read_is_in_flight(ov_adapters: dict[str, Path],
                                                              tiny_model_dir: Path) -> None:
    engine = overlap_engine(tiny_model_dir, ov_adapters)
    enc = engine.tokenizer.encode
    old_key = engine.lora.resolve("x")
    engine.add_request("old", enc(PROMPTS[0]), SHORT, adapter="x")
    engine.step()  # starts the read
    assert engine.lora.reader.busy(old_key)
    # In-place reload (new weights, new key) while the old key's read runs: the waiting request keeps
    # the weights it was added with, a new one gets the new weights.
    engine.lora.load("x", str(ov_adapters["w"]), inplace=True)
    engine.add_request("new", enc(PROMPTS[0]), SHORT, adapter="x")
    # Unload while the old read may still be in flight: new requests are refused at once.
    engine.lora.unload("x")
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("gone", enc(PROMPTS[0]), SHORT, adapter="x")
    res: dict[str, list[int]] = {}
    done: dict[str, RequestOutput] = {}
    drain(engine, res, done)
    assert {k: o.finish_reason for k, o in done.items()} == {"old": "length", "new": "length"}
    assert res["old"] == reference(tiny_model_dir, ov_adapters, "x", 0, SHORT)
    assert res["new"] == reference(tiny_model_dir, ov_adapters, "w", 0, SHORT)
    assert res["old"] != res["new"]
    assert not [k for k in engine.lora.keys if k.startswith("x@")]  # both generations left with their requests
    assert not [k for k in engine.lora.host._items if k.startswith("x@")]


def test_read_outcome_of_a_dropped_key_is_discarded(ov_adapters: dict[str, Path], tiny_model_dir: Path) -> None:
    engine = overlap_engine(tiny_model_dir, ov_adapters)
    key = engine.lora.resolve("x")
    engine.add_request("a", engine.tokenizer.encode(PROMPTS[0]), SHORT, adapter="x")
    engine.step()
    assert engine.lora.reader.busy(key)
    engine.abort("a")
    engine.lora.unload("x")  # no request holds the key: dropped now, read still running
    assert key not in engine.lora.keys
    while engine.lora.reader.busy(key):
        engine.lora.poll_loads()
    assert key not in engine.lora.host and key not in engine.lora.keys
    assert engine.lora.pool.lookup(key) is None


def test_async_engine_waits_for_a_read_without_spinning_and_finishes_everything(
        ov_adapters: dict[str, Path], tiny_model_dir: Path) -> None:
    """The server's loop: with only a cold request left it sleeps until the read ends, then serves it."""
    from appliance.engine.async_engine import AsyncEngine

    engine = overlap_engine(tiny_model_dir, ov_adapters)
    aeng = AsyncEngine(engine)
    aeng.start()

    async def one(prompt: int, adapter: str | None) -> list[int]:
        toks: list[int] = []
        async for o in aeng.generate(engine.tokenizer.encode(PROMPTS[prompt]), SHORT, adapter=adapter):
            toks += o.token_ids
        return toks

    async def main() -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(one(2, "x"), one(0, None), one(3, "x")), 120)

    try:
        got = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert got[0] == reference(tiny_model_dir, ov_adapters, "x", 2, SHORT)
    assert got[2] == reference(tiny_model_dir, ov_adapters, "x", 3, SHORT)
    assert len(got[1]) == SHORT.max_tokens
