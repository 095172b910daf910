from __future__ import annotations

import pytest

from appliance.engine.block_manager import BlockManager
from appliance.engine.request import SamplingParams
from appliance.engine.sequence import Sequence


def seq(n: int = 1) -> Sequence:
    return Sequence("s", [1] * n, SamplingParams(), 0.0)


def test_allocate_grows_table_to_cover_tokens() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq()
    bm.allocate(s, 5)
    assert len(s.block_table) == 2 and bm.num_free == 2
    bm.allocate(s, 8)  # still fits in 2 blocks
    assert len(s.block_table) == 2
    bm.allocate(s, 9)
    assert len(s.block_table) == 3 and bm.num_used == 3


def test_free_returns_blocks_and_double_free_fails() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    s = seq()
    bm.allocate(s, 6)
    assert bm.num_free == 0 and not bm.can_allocate(seq(), 1)
    table = list(s.block_table)
    bm.free(s)
    assert bm.num_free == 3 and s.block_table == []
    s.block_table = table
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(s)


def test_out_of_blocks_raises() -> None:
    bm = BlockManager(num_blocks=1, block_size=2)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(seq(), 3)
