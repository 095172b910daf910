"""The kernels' per-step metadata: SGMV segments and chunked-SGMV chunks, built from the step's sequences."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.segments import csgmv_segments, rows_covered, sgmv_segments, sorted_segments_device, to_device

CPU = torch.device("cpu")


def test_sgmv_drops_base_and_merges_neighbours_of_one_slot() -> None:
    segs = sgmv_segments([3, 2, 1, 4, 1, 2], [0, 0, -1, 2, 0, -1], CPU)
    assert segs.starts.tolist() == [0, 6, 10]
    assert segs.lens.tolist() == [5, 4, 1]
    assert segs.slots.tolist() == [0, 2, 0]
    assert segs.token_index is None and segs.max_len == 5
    assert all(t.dtype == torch.int32 for t in (segs.starts, segs.lens, segs.slots))


def test_csgmv_sorts_by_slot_and_chunks() -> None:
    seg_lens, seg_slots = [3, 2, 1, 4, 1, 1], [2, 0, -1, 2, 0, 2]
    segs = csgmv_segments(seg_lens, seg_slots, 3, CPU)
    # slot 0: rows 3, 4, 10; slot 2: rows 0, 1, 2, 6, 7, 8, 9, 11 -> chunks of at most 3
    assert segs.token_index.tolist() == [3, 4, 10, 0, 1, 2, 6, 7, 8, 9, 11]
    assert segs.slots.tolist() == [0, 2, 2, 2]
    assert segs.starts.tolist() == [0, 3, 6, 9]
    assert segs.lens.tolist() == [3, 3, 3, 2]
    assert segs.max_len == 3


def test_all_base_step_has_no_segment() -> None:
    for segs in (sgmv_segments([2, 5], [-1, -1], CPU), csgmv_segments([2, 5], [-1, -1], 4, CPU)):
        assert segs.num_segs == 0 and segs.max_len == 0


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_chunk_size"):
        csgmv_segments([1], [0], 0, CPU)


def test_both_builders_list_the_base_rows() -> None:
    # lora_expand's write mode zeroes exactly these rows; with the adapter rows they cover the step.
    seg_lens, seg_slots = [3, 2, 1, 4, 1], [0, -1, 2, -1, 0]
    for segs in (sgmv_segments(seg_lens, seg_slots, CPU), csgmv_segments(seg_lens, seg_slots, 2, CPU)):
        assert segs.base_rows.tolist() == [3, 4, 6, 7, 8, 9]
        assert segs.base_rows.dtype == torch.int32 and segs.num_rows == 5


@pytest.mark.parametrize("lens", [[1], [3, 5], [2, 2, 7], [1, 1, 1, 1, 1]])
def test_to_device_views_start_on_16_bytes(lens: list[int]) -> None:
    """Triton specializes pointers on 16-byte alignment: packed views would recompile per step layout."""
    parts = [list(range(n)) for n in lens]
    views = to_device(parts, torch.device("cpu"))
    assert [v.tolist() for v in views] == parts
    assert all(v.data_ptr() % 16 == 0 for v in views)


def test_sorted_segments_device_is_csgmv_layout_on_a_fixed_grid() -> None:
    # The CUDA-graph decode's slot-sorted layout (one-token rows, built on the device): the same chunks
    # and token order as csgmv_segments, then the base rows (sorted last) in chunks of slot -1, then a
    # tail of empty segments (length 0, slot -1) up to the fixed count cdiv(b, chunk) + min(S + 1, b).
    rng = random.Random(0)
    for _ in range(200):
        b, S, chunk = rng.randint(1, 40), rng.randint(1, 9), rng.randint(1, 8)
        row_slots = [rng.choice([-1] + list(range(S))) for _ in range(b)]
        got = sorted_segments_device(torch.tensor(row_slots, dtype=torch.int32), S, chunk)
        want = csgmv_segments([1] * b, row_slots, chunk, torch.device("cpu"))
        n, a = want.num_segs, want.num_rows
        nb = -(-(b - a) // chunk)  # the base rows' chunks
        assert got.num_segs == -(-b // chunk) + min(S + 1, b) >= n + nb
        assert got.starts[:n].tolist() == want.starts.tolist()
        assert got.lens[:n].tolist() == want.lens.tolist()
        assert got.slots[:n].tolist() == want.slots.tolist()
        assert got.starts[n:n + nb].tolist() == [a + j * chunk for j in range(nb)]
        assert got.lens[n:n + nb].tolist() == [min(chunk, b - a - j * chunk) for j in range(nb)]
        assert set(got.slots[n:].tolist()) <= {-1} and set(got.lens[n + nb:].tolist()) <= {0}
        assert got.token_index[:a].tolist() == want.token_index.tolist()
        assert sorted(got.token_index.tolist()) == list(range(b))
        assert [row_slots[r] for r in got.token_index[a:].tolist()] == [-1] * (b - a)  # base rows last
        assert got.max_len == chunk and got.static_sorted and got.base_rows is None
        assert all(t.dtype == torch.int32 for t in (got.starts, got.lens, got.slots, got.token_index))
        assert rows_covered(got) == b  # every row in one segment: silu_mul_lora takes it
