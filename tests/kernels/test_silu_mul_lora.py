"""kernels/silu_mul_lora.py: gate_up's LoRA expand fused into the MLP's activation (both bodies).

Checked two ways: against the two kernels it replaces (lora_expand in add mode on a copy of gate_up,
then silu_mul), which it must equal bit for bit, and against the torch twin within the dtype's
rounding. Layouts: the static decode batch (one segment per row, base and padding rows at slot -1,
no base_rows), eager decode (segments for adapter rows, base_rows for the rest) and chunked SGMV
(rows gathered through token_index); prefill-shaped steps (multi-token segments, the tile body) in
both strategies with base rows and decode tokens mixed in; h in one plane and in K-split planes; mixed
ranks with NaN in B's rank padding (must never be read); the output poisoned with NaN first.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.segments import LoRASegments, csgmv_segments, sgmv_segments, sorted_segments_device
from kernels.silu_mul import silu_mul
from kernels.silu_mul_lora import silu_mul_lora

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# against the twin: bf16 values up to ~10 after three roundings (delta, activation, product), and the
# interpreter truncates fp32 -> bf16 where a GPU rounds: a few ulps (0.0625 at 8)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (0.25, 5e-2)}
S, R, K, I = 4, 16, 64, 80  # slots, max rank, in features, intermediate size (not a power of two)
RANKS = [16, 8, 0, 4]  # slot 2 empty


def weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    A = torch.randn(S, 2, R, K, generator=g) * 0.3
    B = torch.randn(S, 2 * I, R, generator=g) * 0.3
    for s, r in enumerate(RANKS):
        A[s, :, r:] = 0.0
        B[s, :, r:] = float("nan")  # rank padding: the kernels mask it, so it must not leak
    return A.to(dtype).to(DEV), B.to(dtype).to(DEV), torch.tensor(RANKS, dtype=torch.int32, device=DEV)


def static_batch(slots: list[int]) -> LoRASegments:
    """engine/cuda_graph.py's layout: one segment per row, base and padding rows at slot -1."""
    t = len(slots)
    ar = torch.arange(t, dtype=torch.int32, device=DEV)
    return LoRASegments(ar, torch.ones(t, dtype=torch.int32, device=DEV),
                        torch.tensor(slots, dtype=torch.int32, device=DEV), None, 1)


LAYOUTS = {
    "static": lambda slots: static_batch(slots),
    "eager": lambda slots: sgmv_segments([1] * len(slots), slots, DEV),
    "csgmv": lambda slots: csgmv_segments([1] * len(slots), slots, 1, DEV),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("split_k", [1, 3])
def test_equals_expand_then_silu_mul(dtype: torch.dtype, layout: str, split_k: int) -> None:
    slots = [0, -1, 1, 3, 2, 0, -1, 1]  # adjacent rows on different slots: one-token segments
    segs = LAYOUTS[layout](slots)
    assert segs.max_len == 1
    A, B, ranks = weights(dtype)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(len(slots), K, generator=g)).to(dtype).to(DEV)
    gate_up = (torch.randn(len(slots), 2 * I, generator=g) * 2).to(dtype).to(DEV)
    # 16-wide K steps, so that 3 splits of K = 64 leave partial sums in more than one plane
    h = lora_shrink(x, A, segs, ranks, split_k=split_k, partials=True, block_k=16)  # [P, T, 2, R]
    # (only adapter rows' h[:rank] is written: row 0 is on slot 0, rank 16; the rest may be garbage)
    assert h.shape[0] == split_k and (split_k == 1 or h[1, 0].abs().sum() > 0)
    before = gate_up.clone()
    out = torch.full((len(slots), I), float("nan"), dtype=dtype, device=DEV)
    got = silu_mul_lora(gate_up, h, B, segs, ranks, out=out, block=32)
    assert got is out and not got.isnan().any(), "an output element was not written (or B's padding leaked)"
    assert torch.equal(gate_up, before), "gate_up must be left as it was"
    want = silu_mul(lora_expand(gate_up.clone(), h, B, segs, ranks, [0, I, 2 * I]))
    assert torch.equal(got, want), "must equal lora_expand then silu_mul bit for bit"
    token_slots = torch.tensor(slots, device=DEV)
    twin = ref.silu_mul_lora(gate_up, h, B.nan_to_num(0.0), token_slots, ranks)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), twin.float(), atol=atol, rtol=rtol)
    # the delta is really there: an adapter row differs from the base activation
    assert not torch.allclose(got[0].float(), silu_mul(gate_up)[0].float())
    torch.testing.assert_close(got[1].float(), silu_mul(gate_up)[1].float(), atol=0, rtol=0)  # base row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [2, 1])
def test_static_sorted_chunks_take_the_tile_body(dtype: torch.dtype, chunk: int) -> None:
    """The CUDA-graph decode's slot-sorted layout (sorted_segments_device): adapter rows in chunks of
    their slot, base and padding rows in chunks of slot -1 (no delta), an empty tail; no base rows
    listed. The tile body must write every row, equal to lora_expand then silu_mul bit for bit.
    Chunks of 1 (lora.max_chunk_size 1) too: one-token segments plus the empty tail, which the
    one-token body (no segment length) would have written over row token_index[0]."""
    slots = [0, -1, 1, 0, 3, 0, -1, 1, 2, 0, -1, -1]  # slot 2 empty (rank 0), base rows between
    segs = sorted_segments_device(torch.tensor(slots, dtype=torch.int32, device=DEV), S, chunk)
    assert segs.static_sorted and segs.base_rows is None and segs.max_len == chunk
    assert 0 in segs.lens.tolist()  # an empty tail segment
    A, B, ranks = weights(dtype)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(len(slots), K, generator=g)).to(dtype).to(DEV)
    gate_up = (torch.randn(len(slots), 2 * I, generator=g) * 2).to(dtype).to(DEV)
    h = lora_shrink(x, A, segs, ranks, partials=True)
    before = gate_up.clone()
    out = torch.full((len(slots), I), float("nan"), dtype=dtype, device=DEV)
    got = silu_mul_lora(gate_up, h, B, segs, ranks, out=out)
    assert got is out and not got.isnan().any(), "an output element was not written (or B's padding leaked)"
    assert torch.equal(gate_up, before), "gate_up must be left as it was"
    want = silu_mul(lora_expand(gate_up.clone(), h, B, segs, ranks, [0, I, 2 * I]))
    if dtype == torch.float32:  # the interpreter's fp32 tl.dot: order by tile shape (see the prefill test)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    else:
        assert torch.equal(got, want), "must equal lora_expand then silu_mul bit for bit"
    twin = ref.silu_mul_lora(gate_up, h, B.nan_to_num(0.0), torch.tensor(slots, device=DEV), ranks)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), twin.float(), atol=atol, rtol=rtol)
    base = [i for i, s in enumerate(slots) if s < 0 or RANKS[s] == 0]
    torch.testing.assert_close(got[base].float(), silu_mul(gate_up)[base].float(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unrolled_plane_sums_equal_the_loop(dtype: torch.dtype) -> None:
    """The tile bodies of lora_expand and silu_mul_lora on the decode graphs' sorted chunks add the
    shrink's K-split planes through plane_sum's unrolled, masked loads (kernels/lora_bodies.py): the
    same sums, in the same order, as the loop over the planes, bit for bit, whatever the plane count
    below the unroll; and an unroll that would miss planes is refused."""
    slots = [0, -1, 1, 0, 3, 0, -1, 1, 2, 0, -1, -1, 3, 3, 1, 0]
    segs = sorted_segments_device(torch.tensor(slots, dtype=torch.int32, device=DEV), S, 4)
    A, B, ranks = weights(dtype)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(len(slots), K, generator=g)).to(dtype).to(DEV)
    gate_up = (torch.randn(len(slots), 2 * I, generator=g) * 2).to(dtype).to(DEV)
    for split in (1, 3, 4):
        h = lora_shrink(x, A, segs, ranks, split_k=split, partials=True, block_k=16)
        assert h.shape[0] == split
        got = silu_mul_lora(gate_up, h, B, segs, ranks)  # the launcher's unroll for 16-row tiles
        loop = silu_mul_lora(gate_up, h, B, segs, ranks, unroll=0)
        assert torch.equal(got, loop), f"silu_mul_lora, {split} planes: unrolled sums != the loop's"
        y_un = lora_expand(gate_up.clone(), h, B, segs, ranks, [0, I, 2 * I])
        y_loop = lora_expand(gate_up.clone(), h, B, segs, ranks, [0, I, 2 * I], unroll=0)
        assert torch.equal(y_un, y_loop), f"lora_expand, {split} planes: unrolled sums != the loop's"
        if dtype == torch.bfloat16:  # and still lora_expand then silu_mul, as the other layouts
            assert torch.equal(got, silu_mul(y_un))
    h = lora_shrink(x, A, segs, ranks, split_k=3, partials=True, block_k=16)
    with pytest.raises(ValueError, match="unroll"):
        silu_mul_lora(gate_up, h, B, segs, ranks, unroll=2)
    with pytest.raises(ValueError, match="unroll"):
        lora_expand(gate_up.clone(), h, B, segs, ranks, [0, I, 2 * I], unroll=2)


PREFILL = {  # (sequence lengths, slots): the tile body
    # a 37-token prefill (three 16-row tiles, the last partial), a base prefill, decode tokens, rank 4
    "mixed": ([37, 9, 1, 1, 20, 1], [0, -1, 1, -1, 3, 2]),
    "one adapter": ([24, 24], [1, 1]),  # merged into one 48-token segment
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["sgmv", "csgmv"])
# split_k 3 (planes summed in the tile body) on the mixed step only: the merged segment reads h alike
@pytest.mark.parametrize("split_k,step", [(1, "mixed"), (3, "mixed"), (1, "one adapter")])
def test_prefill_tiles_equal_expand_then_silu_mul(dtype: torch.dtype, strategy: str, step: str,
                                                  split_k: int) -> None:
    lens, slots = PREFILL[step]
    segs = (sgmv_segments(lens, slots, DEV) if strategy == "sgmv" else csgmv_segments(lens, slots, 11, DEV))
    assert segs.max_len > 1
    T = sum(lens)
    A, B, ranks = weights(dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, K, generator=g).to(dtype).to(DEV)
    gate_up = (torch.randn(T, 2 * I, generator=g) * 2).to(dtype).to(DEV)
    h = lora_shrink(x, A, segs, ranks, split_k=split_k, partials=True, block_k=16)
    before = gate_up.clone()
    out = torch.full((T, I), float("nan"), dtype=dtype, device=DEV)
    # 16-column steps, 48 columns a program: I = 80 takes two programs, the second's last step partial
    got = silu_mul_lora(gate_up, h, B, segs, ranks, out=out, block_m=16, block_n=16, cols_per_prog=48)
    assert got is out and not got.isnan().any(), "an output element was not written (or B's padding leaked)"
    assert torch.equal(gate_up, before), "gate_up must be left as it was"
    assert torch.equal(silu_mul_lora(gate_up, h, B, segs, ranks, block_m=16, block_n=16), got), \
        "the column split must not change a bit"
    want = silu_mul(lora_expand(gate_up.clone(), h, B, segs, ranks, [0, I, 2 * I]))
    if dtype == torch.float32:
        # the interpreter's fp32 tl.dot is numpy's matmul, whose summation order follows the tile's
        # shape (lora_expand's tiles are 64 x 128 here): the last bits may differ
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    else:
        assert torch.equal(got, want), "must equal lora_expand then silu_mul bit for bit"
    token_slots = torch.tensor([s for n, s in zip(lens, slots) for _ in range(n)], device=DEV)
    twin = ref.silu_mul_lora(gate_up, h, B.nan_to_num(0.0), token_slots, ranks)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), twin.float(), atol=atol, rtol=rtol)
    plain = silu_mul(gate_up)
    base = token_slots < 0
    torch.testing.assert_close(got[base].float(), plain[base].float(), atol=0, rtol=0)  # base rows
    assert not torch.allclose(got[~base].float(), plain[~base].float())  # the delta is really there


def test_scalings_and_refusals() -> None:
    A, B, ranks = weights(torch.float32)
    slots = [1, 0, -1]
    segs = LAYOUTS["eager"](slots)
    x = torch.randn(3, K, device=DEV)
    gate_up = torch.randn(3, 2 * I, device=DEV)
    h = lora_shrink(x, A, segs, ranks, partials=True)
    scal = torch.tensor([0.5, 2.0, 1.0, 3.0], device=DEV)
    got = silu_mul_lora(gate_up, h, B, segs, ranks, scal)
    want = silu_mul(lora_expand(gate_up.clone(), h, B, segs, ranks, [0, I, 2 * I], scal))
    assert torch.equal(got, want)
    long = sgmv_segments([2, 1], [0, -1], DEV)
    long.base_rows = None
    with pytest.raises(ValueError, match="must list the base rows"):
        silu_mul_lora(gate_up, h, B, long, ranks)
    got = silu_mul_lora(gate_up, h, B, sgmv_segments([2, 1], [1, -1], DEV), ranks, scal)  # the tile body
    want = silu_mul(lora_expand(gate_up.clone(), h, B, sgmv_segments([2, 1], [1, -1], DEV), ranks, [0, I, 2 * I],
                                scal))
    # fp32 tile shapes differ from lora_expand's: the interpreter's matmul may differ in the last bits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    with pytest.raises(ValueError, match="cover every row"):
        silu_mul_lora(gate_up, h, B, sgmv_segments([1, 1], [0, 1], DEV), ranks)  # row 2 in neither
    with pytest.raises(ValueError, match="no segment"):
        silu_mul_lora(gate_up, h, B, sgmv_segments([1, 1, 1], [-1, -1, -1], DEV), ranks)
    with pytest.raises(ValueError, match="shapes disagree"):
        silu_mul_lora(gate_up[:, :-2], h, B, segs, ranks)
