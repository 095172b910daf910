"""Async scheduling (engine/async_step.py) against the synchronous engine, on CPU.

Both engines run decode steps over the uncaptured static buffers (what a CUDA graph replays); with
async scheduling on, a decode step is launched before the tokens of the one before are read, and its
pending input tokens come from the device. Every request must get exactly the tokens, text and finish
reason of the synchronous run: greedy and seeded sampling, stop tokens, stop strings, min_tokens,
requests arriving mid-decode (a prefill step settles the step in flight), aborts in flight.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from tests.conftest import default_config
from tests.engine.test_static_decode import uncaptured_static_decode

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "Water boils at", "1, 2, 3,", "Roses are red,"]


def make_engine(model_dir: Path, async_on: bool) -> tuple[LLMEngine, list[int]]:
    eng = LLMEngine(default_config(f"model.path={model_dir}", "engine.num_kv_blocks=64",
                                   f"engine.async_scheduling={str(async_on).lower()}"))
    _, used = uncaptured_static_decode(eng)
    assert eng.async_scheduling is async_on
    return eng, used


def params_for(i: int, stop_token: int | None = None, stop: list[str] | None = None) -> SamplingParams:
    """A mix: greedy to a length, sampled with a seed, top-k/top-p, min_tokens, stops."""
    kinds = [
        dict(max_tokens=3, temperature=0.0, ignore_eos=True),
        dict(max_tokens=9, temperature=0.9, seed=7, ignore_eos=True),
        dict(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token] if stop_token else []),
        dict(max_tokens=7, temperature=1.0, top_k=20, top_p=0.9, seed=3, min_tokens=5,
             stop_token_ids=[stop_token] if stop_token else []),
        dict(max_tokens=10, temperature=0.0, stop=stop or []),
        dict(max_tokens=5, temperature=0.7, ignore_eos=True),  # unseeded: seeded by the engine's model.seed
    ]
    return SamplingParams(**kinds[i % len(kinds)])


def run(eng: LLMEngine, late: int = 0, **kw) -> dict[str, tuple[list[int], str, str]]:
    """All but the last `late` prompts at once, those after a few steps; id -> (ids, text, finish)."""
    res: dict[str, tuple[list[int], str, str]] = {}
    pending = list(enumerate(PROMPTS))
    first, rest = pending[:len(pending) - late], pending[len(pending) - late:]
    for i, p in first:
        eng.add_request(str(i), eng.tokenizer.encode(p), params_for(i, **kw))
    steps = 0
    while eng.has_unfinished() or rest:
        steps += 1
        if steps == 4:
            for i, p in rest:
                eng.add_request(str(i), eng.tokenizer.encode(p), params_for(i, **kw))
            rest = []
        for out in eng.step():
            ids, text, _ = res.get(out.request_id, ([], "", ""))
            res[out.request_id] = (ids + out.token_ids, text + out.text, out.finish_reason or "")
    assert eng.block_manager.num_used == 0 and not eng.scheduler.running and eng._inflight is None
    return res


@pytest.fixture(scope="module")
def sync_run(tiny_model_dir: Path) -> dict:
    eng, used = make_engine(tiny_model_dir, False)
    return run(eng)


def test_async_gives_the_sync_tokens(tiny_model_dir: Path, sync_run: dict) -> None:
    eng, used = make_engine(tiny_model_dir, True)
    assert run(eng) == sync_run
    assert used and max(used) == len(PROMPTS)


def test_async_with_stops_and_late_arrivals(tiny_model_dir: Path, sync_run: dict) -> None:
    """Stop tokens and strings end requests at a step whose next one is already launched (its row is
    dropped); late requests make prefill steps that settle the step in flight."""
    stop_token = sync_run["2"][0][4]  # request 2's fifth greedy token: it stops there
    text4 = sync_run["4"][1]
    stop = [text4[len(text4) // 2:len(text4) // 2 + 2]] if len(text4) > 4 else []
    want = run(make_engine(tiny_model_dir, False)[0], late=2, stop_token=stop_token, stop=stop)
    assert len(want["2"][0]) <= 4 and want["2"][2] == "stop"
    eng, used = make_engine(tiny_model_dir, True)
    assert run(eng, late=2, stop_token=stop_token, stop=stop) == want


def test_pipeline_keeps_one_step_in_flight_and_wastes_no_row_on_length(tiny_model_dir: Path) -> None:
    """After a decode step call the next step is queued and the last one's tokens are out; requests
    that end by length are not given a row past their last token."""
    eng, used = make_engine(tiny_model_dir, True)
    lengths = [2, 4, 6]
    for i, n in enumerate(lengths):
        eng.add_request(str(i), eng.tokenizer.encode(PROMPTS[i]),
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    got: dict[str, int] = {}
    saw_in_flight = False
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] = got.get(out.request_id, 0) + len(out.token_ids)
        saw_in_flight |= eng._inflight is not None
    assert got == {str(i): n for i, n in enumerate(lengths)}
    assert saw_in_flight
    # The first token of each comes from its prefill; every other token from exactly one decode row.
    assert sum(used) == sum(n - 1 for n in lengths)


def test_abort_while_in_flight(tiny_model_dir: Path) -> None:
    eng, _ = make_engine(tiny_model_dir, True)
    for i in range(3):
        eng.add_request(str(i), eng.tokenizer.encode(PROMPTS[i]),
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    got: dict[str, int] = {}
    steps = 0
    while eng.has_unfinished():
        steps += 1
        for out in eng.step():
            got[out.request_id] = got.get(out.request_id, 0) + len(out.token_ids)
            assert out.request_id != "1" or steps <= 3
        if steps == 3:
            assert eng._inflight is not None and eng.seqs["1"].num_pending == 1
            eng.abort("1")  # its token in flight is dropped
    assert got["0"] == 8 and got["2"] == 8 and got["1"] < 8
    assert eng.block_manager.num_used == 0



def test_async_engine_streams_settles_for_admin_calls_and_aborts(tiny_model_dir: Path, sync_run: dict) -> None:
    """The server's loop with async scheduling: streamed requests get the sync tokens, an admin call
    (run on the engine thread between steps) sees no step in flight, and a stream closed early aborts
    its request while its step may be in flight; every KV block comes back."""
    import asyncio

    from appliance.engine.async_engine import AsyncEngine

    eng, _ = make_engine(tiny_model_dir, True)
    aeng = AsyncEngine(eng)
    aeng.start()
    seen_in_call: list[object] = []

    async def one(i: int, stop_after: int | None = None) -> tuple[list[int], str]:
        ids: list[int] = []
        finish = ""
        agen = aeng.generate(eng.tokenizer.encode(PROMPTS[i]), params_for(i), request_id=f"r{i}")
        async for o in agen:
            ids += o.token_ids
            finish = o.finish_reason or ""
            if stop_after is not None and len(ids) >= stop_after:
                await agen.aclose()  # the client goes away: the request is aborted
                break
        return ids, finish

    async def admin() -> None:
        for _ in range(5):
            await asyncio.sleep(0.01)
            seen_in_call.append(await aeng.call(lambda: eng._inflight))

    async def main() -> list:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(PROMPTS) - 1)),
                                                     one(len(PROMPTS) - 1, stop_after=2), admin()), 120)

    try:
        got = asyncio.run(main())
    finally:
        aeng.shutdown()
    for i in range(len(PROMPTS) - 1):
        assert got[i] == (sync_run[str(i)][0], sync_run[str(i)][2]), i
    last = len(PROMPTS) - 1
    assert got[last][0] == sync_run[str(last)][0][:len(got[last][0])] and len(got[last][0]) >= 2
    assert seen_in_call and all(x is None for x in seen_in_call)
    assert eng.block_manager.num_used == 0 and not eng.has_unfinished()


def test_async_logprobs_and_penalties_match_sync(tiny_model_dir: Path) -> None:
    """Logprobs travel with the launched step's tokens; a penalised request's steps read the step
    before ahead of their sampling (its penalties read every generated token) without changing any token."""
    kinds = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True, logprobs=0),
             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=1.5,
                            repetition_penalty=1.3),
             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)]

    def go(eng: LLMEngine) -> dict:
        res: dict[str, list] = {}
        for i, p in enumerate(PROMPTS[:4]):
            eng.add_request(str(i), eng.tokenizer.encode(p), kinds[i])
        while eng.has_unfinished():
            for out in eng.step():
                r = res.setdefault(out.request_id, [[], []])
                r[0] += out.token_ids
                r[1] += [(lp.token_id, round(lp.logprob, 5), [(t, round(v, 5)) for t, v in lp.top])
                         for lp in out.logprobs or []]
        return res

    want = go(make_engine(tiny_model_dir, False)[0])
    assert all(len(want[str(i)][1]) == kinds[i].max_tokens for i in (0, 1, 3))
    assert go(make_engine(tiny_model_dir, True)[0]) == want
