"""RequestGroup's merging of queued updates: a stream that falls behind gets fewer, larger events with
every token and every character, in order, and an error still surfaces."""

from __future__ import annotations

import asyncio

import pytest

from appliance.engine.request import RequestOutput, SamplingParams
from appliance.server.group import RequestGroup
from appliance.server.protocol import Job


def out(tokens: list[int], text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", tokens, text, finished=finished, finish_reason="length" if finished else None,
                         completion_tokens=0)


def group(jobs: int) -> RequestGroup:
    # The engine is never called: the test feeds the group's queue as the job tasks would.
    return RequestGroup(None, [Job([1], SamplingParams()) for _ in range(jobs)], "g")  # type: ignore[arg-type]


def test_backlogged_updates_of_one_job_are_merged_in_order() -> None:
    async def run() -> list[tuple[int, list[int], str, bool]]:
        g = group(2)
        for item in [(0, out([1], "a")), (0, out([2], "b")), (1, out([7], "x")), (0, out([3], "c", True)),
                     (1, out([8], "y", True))]:
            g._queue.put_nowait(item)
        return [(i, o.token_ids, o.text, o.finished) async for i, o in g.updates()]

    events = asyncio.run(run())
    assert events == [(0, [1, 2], "ab", False), (1, [7], "x", False), (0, [3], "c", True), (1, [8], "y", True)]


def test_an_error_behind_updates_is_raised_after_them() -> None:
    async def run(seen: list) -> None:
        g = group(1)
        for item in [(0, out([1], "a")), (0, out([2], "b")), (0, RuntimeError("engine stopped"))]:
            g._queue.put_nowait(item)
        async for i, o in g.updates():
            seen.append((o.token_ids, o.text))

    seen: list = []
    with pytest.raises(RuntimeError, match="engine stopped"):
        asyncio.run(run(seen))
    assert seen == [([1, 2], "ab")]
