"""The Triton shrink/expand kernels against their torch twins (kernels/reference.py), punica-style.

On CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on a GPU compiled.
Sweeps: how adapters spread over the batch (distinct, uniform, zipf, identical, skewed; base tokens
mixed in), decode and prefill shapes, both strategies (triton = SGMV, csgmv = sorted chunks), dtypes
with a tolerance table, ranks 1..64 and mixed ranks in one batch, hidden sizes that are not powers of
two. Every case poisons with NaN what must not be read or is not meant to be written: A and B beyond
each slot's rank, all of an empty slot, and h before the shrink; a NaN that leaks shows as a mismatch.
Sizes are small where they can be: each interpreted kernel program costs tens of milliseconds.
"""

from __future__ import annotations

import math
import random
from typing import Optional

import pytest
import torch

from kernels import reference as ref
from kernels.lora_apply import lora_apply
from kernels.lora_expand import lora_expand
from kernels.lora_linear import lora_linear
from kernels.lora_shrink import lora_shrink
from kernels.segments import LoRASegments, csgmv_segments, sgmv_segments

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {  # dtype -> (atol, rtol) of the kernel against the same-dtype torch twin, values of order 1
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
LAYOUTS = ("distinct", "uniform", "zipf", "identical", "skewed")


def batch_layout(layout: str, num_seqs: int, num_slots: int, rng: random.Random) -> list[int]:
    """Slot of each sequence; every third sequence is a base request (-1)."""
    if layout == "distinct":
        slots = [i % num_slots for i in range(num_seqs)]
    elif layout == "uniform":
        slots = [rng.randrange(num_slots) for _ in range(num_seqs)]
    elif layout == "zipf":
        w = [1 / (k + 1) ** 1.5 for k in range(num_slots)]
        slots = rng.choices(range(num_slots), weights=w, k=num_seqs)
    elif layout == "identical":
        slots = [1] * num_seqs
    elif layout == "skewed":  # one hot adapter, a long tail of one request each
        slots = [0 if i % 2 == 0 else 1 + (i // 2) % (num_slots - 1) for i in range(num_seqs)]
    else:
        raise ValueError(layout)
    return [-1 if i % 3 == 2 else s for i, s in enumerate(slots)]


def segments(strategy: str, seg_lens: list[int], seg_slots: list[int], chunk: int) -> LoRASegments:
    if strategy == "triton":
        return sgmv_segments(seg_lens, seg_slots, DEV)
    return csgmv_segments(seg_lens, seg_slots, chunk, DEV)


def check_case(strategy: str, dtype: torch.dtype, seg_lens: list[int], seg_slots: list[int], ranks: list[int],
               K: int, slices: list[int], R: int, chunk: int = 4, split_k: int = 1,
               with_scale: bool = False, seed: int = 0, shrink_kw: Optional[dict] = None,
               expand_kw: Optional[dict] = None, apply_kw: Optional[dict] = None, partials: bool = False,
               write: bool = False) -> None:
    """apply_kw: check lora_apply (shrink + expand in one call, fused or not) with these arguments
    instead of the two ops one after the other. partials: the shrink's K splits in planes of their own
    (summed by the expand). write: the expand's write mode on a NaN-poisoned y (never read; base rows
    must end as 0)."""
    g = torch.Generator().manual_seed(seed)
    S, n = len(ranks), len(slices)
    offs = [0]
    for s in slices:
        offs.append(offs[-1] + s)
    OUT, T = offs[-1], sum(seg_lens)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    A = randn(S, n, R, K, scale=1 / math.sqrt(K))
    B = randn(S, OUT, R, scale=1 / math.sqrt(R))
    for s, r in enumerate(ranks):  # padding up to R must never be read (nor written, for A's: below)
        A[s, :, r:] = 1000.0
        B[s, :, r:] = float("nan")
    x, y0 = randn(T, K), randn(T, OUT)
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    token_slots = torch.tensor([s for n_, s in zip(seg_lens, seg_slots) for _ in range(n_)], dtype=torch.long)
    scal = torch.rand(S, generator=g) + 0.5 if with_scale else None
    want_h = ref.lora_shrink(x, A, token_slots, ranks_t)
    if write:
        y0 = torch.full((T, OUT), float("nan"), dtype=dtype)
    want_y = ref.lora_expand(y0.clone(), want_h, B, token_slots, offs, ranks_t, scal, write=write)

    segs = segments(strategy, seg_lens, seg_slots, chunk)
    r_dev = ranks_t.to(DEV)
    atol, rtol = TOL[dtype]
    base = token_slots < 0
    if apply_kw is not None:
        y = y0.clone().to(DEV)
        out = lora_apply(y, x.to(DEV), A.to(DEV), B.to(DEV), segs, r_dev, offs,
                         None if scal is None else scal.to(DEV), **apply_kw)
        assert out is y
        y = y.cpu()
        torch.testing.assert_close(y, want_y, atol=atol, rtol=rtol)
        assert torch.equal(y[base], y0[base]), "base tokens' rows changed"
        return
    h = torch.full((split_k, T, n, R) if partials else (T, n, R), float("nan"), device=DEV)
    out = lora_shrink(x.to(DEV), A.to(DEV), segs, r_dev, out=h, split_k=split_k, partials=partials,
                      **(shrink_kw or {}))
    assert out is h
    planes = h.cpu()
    h = planes.sum(0) if partials else planes
    for t in range(T):
        s = int(token_slots[t])
        if s >= 0:  # every element the expand will read was written, and is right
            r = ranks[s]
            torch.testing.assert_close(h[t, :, :r].to(dtype), want_h[t, :, :r], atol=atol, rtol=rtol,
                                       msg=lambda m: f"h of token {t} (slot {s}, rank {r}): {m}")
            if split_k == 1:  # rank padding: no A row loaded, no h written (split-K zeroes h first)
                assert h[t, :, r:].isnan().all(), f"h of token {t} written beyond rank {r}"
        elif split_k == 1:
            assert h[t].isnan().all(), f"h of base token {t} written"
    y = y0.clone().to(DEV)
    lora_expand(y, (planes if partials else h).to(DEV), B.to(DEV), segs, r_dev, offs,
                None if scal is None else scal.to(DEV), write=write, **(expand_kw or {}))
    y = y.cpu()
    torch.testing.assert_close(y, want_y, atol=atol, rtol=rtol)
    if write:
        assert (y[base] == 0).all(), "base tokens' rows not zeroed"
    else:
        assert torch.equal(y[base], y0[base]), "base tokens' rows changed"


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_layouts(layout: str, shape: str, strategy: str) -> None:
    rng = random.Random(f"{layout}-{shape}")
    num_seqs = 10 if shape == "decode" else 4
    seg_slots = batch_layout(layout, num_seqs, 5, rng)
    seg_lens = [1] * num_seqs if shape == "decode" else [rng.randint(3, 37) for _ in range(num_seqs)]
    # qkv-like slices; slot 3 is empty (rank 0), ranks below max_lora_rank elsewhere.
    check_case(strategy, torch.float32, seg_lens, seg_slots, ranks=[16, 8, 12, 0, 5], K=48,
               slices=[32, 16, 16], R=16, chunk=3 if shape == "decode" else 16)


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_dtypes(dtype: torch.dtype, shape: str, strategy: str) -> None:
    rng = random.Random(shape)
    seg_slots = batch_layout("zipf", 6, 4, rng)
    seg_lens = [1] * 6 if shape == "decode" else [rng.randint(5, 40) for _ in range(6)]
    check_case(strategy, dtype, seg_lens, seg_slots, ranks=[16, 4, 16, 9], K=96, slices=[64, 32],
               R=16, chunk=8, with_scale=True)


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("ranks,R", [([1, 1], 1), ([8, 8], 8), ([16, 16], 16), ([64, 64], 64),
                                     ([1, 8, 16, 64], 64)], ids=["r1", "r8", "r16", "r64", "mixed"])
def test_ranks(ranks: list[int], R: int, strategy: str) -> None:
    S = len(ranks)
    seg_slots = [s for s in range(S)] + [-1] + [S - 1]
    seg_lens = [2, 19, 1, 3, 5, 1][:len(seg_slots)]
    check_case(strategy, torch.float32, seg_lens, seg_slots, ranks, K=32, slices=[24, 8, 8], R=R, chunk=8)


@pytest.mark.parametrize("K,slices,strategy", [
    (576, [576, 192, 192], "triton"),  # SmolLM2 qkv
    (576, [1536, 1536], "csgmv"),  # SmolLM2 gate_up
    (1536, [576], "csgmv"),  # SmolLM2 down
    (14336, [576], "triton"),  # Llama-3.1-8B down_proj's in features
])
def test_hidden_sizes(K: int, slices: list[int], strategy: str) -> None:
    check_case(strategy, torch.float32, [2, 1, 1], [0, -1, 1], ranks=[16, 8], K=K, slices=slices, R=16,
               with_scale=True)


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
def test_split_k_partial_sums(strategy: str) -> None:
    # K = 576 is 4.5 blocks of 128: the splits end mid-block, and the last one is short.
    check_case(strategy, torch.float32, [1, 1, 4, 1], [1, 0, 1, -1], ranks=[16, 3], K=576, slices=[40, 24],
               R=16, split_k=3)


@pytest.mark.parametrize("body", ["gemv", "dot"])
@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
def test_tile_overrides(strategy: str, body: str) -> None:
    # Both bodies on multi-token segments (GEMV: one program per row), column ranges per program that
    # end mid-slice (slices 40/24/24 are not multiples of 16), and a K split that ends mid-block.
    bm = 1 if body == "gemv" else 16
    check_case(strategy, torch.float32, [3, 1, 5, 2], [1, -1, 0, 2], ranks=[16, 3, 0], K=80, slices=[40, 24, 24],
               R=16, chunk=4, split_k=2, shrink_kw=dict(block_m=bm, block_k=32, block_n=16),
               expand_kw=dict(block_m=bm, block_n=16, cols_per_prog=32))


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout", ["distinct", "zipf"])
def test_apply_fused_decode(layout: str, dtype: torch.dtype, strategy: str) -> None:
    # One-token segments (triton: neighbours differ; csgmv: chunk 1): the fused kernel, with whole
    # slices per program and with column splits that end mid-slice; mixed ranks, an empty slot.
    seg_slots = batch_layout(layout, 9, 5, random.Random(layout))
    if strategy == "triton":
        seg_slots = [s if k == 0 or s != seg_slots[k - 1] else -1 for k, s in enumerate(seg_slots)]
    for kw in (dict(fused=True), dict(fused=True, block_k=32, block_n=16, cols_per_prog=32)):
        check_case(strategy, dtype, [1] * 9, seg_slots, ranks=[16, 8, 12, 0, 5], K=80, slices=[40, 24, 24],
                   R=16, chunk=1, with_scale=dtype != torch.float32, apply_kw=kw)


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_apply_fused_decode_tma(dtype: torch.dtype, strategy: str) -> None:
    # The fused kernel's TMA body (loads through the copy engine): whole slices per program, then
    # 16-column programs (column tiles inside one slice: 32/16/16 columns); K = 80 is not a multiple of
    # the K step (zero fill past the edge); A's rank padding (1000) and B's (NaN) are loaded and must be
    # masked, an empty slot, base rows, scales; csgmv gathers its token rows.
    if dtype == torch.float32 and DEV.type == "cuda":
        pytest.skip("the TMA body takes bf16/fp16 on CUDA")
    seg_slots = [0, -1, 1, 2, 4, 0, 3, -1, 1]
    if strategy == "csgmv":
        seg_slots = [s if s != 0 else 2 for s in seg_slots]
    for kw in (dict(fused=True, tma=True), dict(fused=True, tma=True, block_k=16, block_n=16, cols_per_prog=16)):
        check_case(strategy, dtype, [1] * 9, seg_slots, ranks=[16, 8, 12, 0, 5], K=80, slices=[32, 16, 16],
                   R=16, chunk=1, with_scale=dtype != torch.float32, apply_kw=kw)


def test_apply_tma_refuses_what_it_cannot_take() -> None:
    # Slice boundaries no 16-column tile divides (40/24/24), or a B row under 16 bytes (rank 2 in fp32):
    # tma=True refuses; the automatic choice takes the pointer body for them.
    with pytest.raises(ValueError, match="slice boundaries"):
        check_case("triton", torch.float32, [1, 1], [0, 1], [16, 8], K=48, slices=[40, 24, 24], R=16,
                   apply_kw=dict(fused=True, tma=True))
    with pytest.raises(ValueError, match="max rank 2"):
        check_case("triton", torch.float32, [1, 1], [0, 1], [2, 1], K=48, slices=[32], R=2,
                   apply_kw=dict(fused=True, tma=True))
    check_case("triton", torch.float32, [1, 1], [0, 1], [2, 1], K=48, slices=[32], R=2, apply_kw=dict(fused=True))


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_apply_unfused_pdl(dtype: torch.dtype, strategy: str) -> None:
    # The decode path with the expand as a programmatic dependent of the shrink (on the CPU: the same
    # bodies in plain launches): K split into 3 planes, one column block of 16 per program, so blocks
    # straddle the slice boundaries of 40/24/24 columns; mixed ranks, an empty slot, base rows, scales.
    seg_slots = [0, -1, 1, 2, 4, 0, 3, -1, 1]
    if strategy == "csgmv":
        seg_slots = [s if s != 0 else 2 for s in seg_slots]
    for kw in (dict(fused=False, pdl=True, split_k=3, block_n=16), dict(fused=False, pdl=True)):
        check_case(strategy, dtype, [1] * 9, seg_slots, ranks=[16, 8, 12, 0, 5], K=80, slices=[40, 24, 24],
                   R=16, chunk=1, with_scale=dtype != torch.float32, apply_kw=kw)


@pytest.mark.parametrize("body", ["gemv", "dot"])
def test_expand_pdl(body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # lora_expand(pdl=True) on its own: the one-token add path takes the one-block-a-program body
    # (planes summed, a block that ends mid-slice); the dot body and write mode only wait (a no-op here).
    # Outputs wider than B_FIRST_MAX_OUT (0 here): the one-token add path keeps the column-loop body.
    import kernels.lora_expand as le

    lens = [1, 1, 1, 1] if body == "gemv" else [1, 6, 1]
    widths = (le.B_FIRST_MAX_OUT, 0)
    for write in ((False,) if body == "gemv" else (False, True)):
        for b_first_max_out in widths:
            monkeypatch.setattr(le, "B_FIRST_MAX_OUT", b_first_max_out)
            check_case("triton", torch.float32, lens, [1, -1, 0, 1][:len(lens)], ranks=[16, 5], K=96,
                       slices=[40, 24], R=16, split_k=2, partials=True, write=write,
                       expand_kw=dict(pdl=True, block_n=16 if body == "gemv" else None))


@pytest.mark.parametrize("ranks,R", [([1, 1], 1), ([64, 3], 64)], ids=["r1", "r64"])
def test_apply_ranks_and_unfused(ranks: list[int], R: int) -> None:
    check_case("triton", torch.float32, [1, 1, 1], [0, -1, 1], ranks, K=48, slices=[32], R=R, apply_kw={})
    # Longer segments: lora_apply falls back to shrink + expand, and refuses to fuse.
    check_case("triton", torch.float32, [3, 1, 2], [0, -1, 1], ranks, K=48, slices=[32], R=R, apply_kw={})
    with pytest.raises(ValueError, match="one-token"):
        check_case("triton", torch.float32, [3, 1], [0, 1], ranks, K=48, slices=[32], R=R, apply_kw=dict(fused=True))


def test_no_adapter_tokens_is_a_no_op() -> None:
    segs = sgmv_segments([3, 1], [-1, -1], DEV)
    A = torch.randn(2, 1, 8, 16, device=DEV)
    B = torch.randn(2, 16, 8, device=DEV)
    x, y = torch.randn(4, 16, device=DEV), torch.randn(4, 16, device=DEV)
    y0 = y.clone()
    h = lora_shrink(x, A, segs, torch.tensor([8, 8], dtype=torch.int32, device=DEV))
    lora_expand(y, h, B, segs, torch.tensor([8, 8], dtype=torch.int32, device=DEV), [0, 16])
    assert torch.equal(y, y0)


def test_launchers_refuse_bad_arguments() -> None:
    segs = sgmv_segments([2], [0], DEV)
    ranks = torch.tensor([4], dtype=torch.int32, device=DEV)
    x = torch.randn(2, 16, device=DEV)
    A = torch.randn(1, 2, 4, 16, device=DEV)
    B = torch.randn(1, 24, 4, device=DEV)
    h = torch.zeros(2, 2, 4, device=DEV)
    y = torch.zeros(2, 24, device=DEV)
    with pytest.raises(ValueError, match="share one of"):
        lora_shrink(x.half(), A, segs, ranks)
    with pytest.raises(ValueError, match="in features"):
        lora_shrink(x[:, :8], A, segs, ranks)
    with pytest.raises(ValueError, match="contiguous"):
        lora_shrink(x, A.transpose(2, 3).contiguous().transpose(2, 3), segs, ranks)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, A, segs, ranks.long())
    with pytest.raises(ValueError, match="slots"):
        lora_shrink(x, A, segs, torch.tensor([4, 4], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="out_offsets"):
        lora_expand(y, h, B, segs, ranks, [0, 10, 20])
    with pytest.raises(ValueError, match="fp32"):
        lora_expand(y, h.half(), B, segs, ranks, [0, 12, 24])
    with pytest.raises(ValueError, match="shapes disagree"):
        lora_expand(y[:, :20], h, B, segs, ranks, [0, 10, 20])
    with pytest.raises(ValueError, match="scalings"):
        lora_expand(y, h, B, segs, ranks, [0, 12, 24], scalings=torch.ones(3, device=DEV))


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("body", ["gemv", "dot"])
def test_expand_write_mode(body: str, strategy: str) -> None:
    # y poisoned with NaN is only written: adapter rows = the delta (0 for the empty slot 2), base
    # rows in between (and first and last) zeroed; mixed ranks; 16-row zeroing programs with a short last one.
    bm = 1 if body == "gemv" else 16
    check_case(strategy, torch.float32, [2, 5, 1, 19, 3, 1, 2], [-1, 1, -1, 0, 2, -1, 1], ranks=[16, 3, 0], K=48,
               slices=[40, 24, 24], R=16, chunk=4, write=True,
               expand_kw=dict(block_m=bm, block_n=16, cols_per_prog=32))


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shrink_partial_planes(dtype: torch.dtype, strategy: str) -> None:
    # K = 576 in 4 planes of 160 (block_k 32): the last plane is short; decode rows (GEMV body)
    # and a prefill segment (dot body) in one step; the expand sums the planes in write mode too.
    for lens, bm in (([1, 1, 1, 1], 1), ([1, 6, 1], 16)):
        check_case(strategy, dtype, lens, [1, -1, 0, 1][:len(lens)], ranks=[16, 5], K=576, slices=[40, 24],
                   R=16, split_k=4, partials=True, write=bm == 16, shrink_kw=dict(block_m=bm, block_k=32))


def test_partial_planes_past_k_are_zero() -> None:
    # More planes than K blocks: the planes past K hold zeros for adapter rows, so their sum is h.
    segs = sgmv_segments([2], [0], DEV)
    ranks = torch.tensor([4], dtype=torch.int32, device=DEV)
    x, A = torch.randn(2, 32, device=DEV), torch.randn(1, 1, 4, 32, device=DEV)
    h = lora_shrink(x, A, segs, ranks, split_k=5, partials=True, block_k=16)
    assert h.shape == (5, 2, 1, 4) and (h[2:] == 0).all()
    torch.testing.assert_close(h.sum(0), ref.lora_shrink(x, A, torch.zeros(2, dtype=torch.long, device=DEV), ranks))


@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("partials", [None, True, False], ids=["auto", "planes", "atomic"])
def test_lora_linear_against_reference(partials: Optional[bool], dtype: torch.dtype, strategy: str) -> None:
    # The prefill path: delta written (base rows zeroed), then x @ Wᵀ accumulated into it, against
    # the torch twin and against the add-after order (lora_apply on x @ Wᵀ) within the dtype's rounding.
    g = torch.Generator().manual_seed(3)
    lens, slots, ranks, K, slices, R = [3, 17, 2, 9, 1], [-1, 0, 2, 1, -1], [16, 4, 0], 40, [24, 8, 8], 16
    S, T, OUT = len(ranks), sum(lens), sum(slices)
    offs = [0, 24, 32, 40]
    A = (torch.randn(S, 3, R, K, generator=g) / math.sqrt(K)).to(dtype)
    B = (torch.randn(S, OUT, R, generator=g) / math.sqrt(R)).to(dtype)
    for s, r in enumerate(ranks):
        A[s, :, r:] = 1000.0
        B[s, :, r:] = float("nan")
    x = torch.randn(T, K, generator=g).to(dtype)
    W = (torch.randn(OUT, K, generator=g) / math.sqrt(K)).to(dtype)
    r_t = torch.tensor(ranks, dtype=torch.int32)
    token_slots = torch.tensor([s for n_, s in zip(lens, slots) for _ in range(n_)])
    want = ref.lora_linear(x, W, A, B, token_slots, offs, r_t)
    segs = segments(strategy, lens, slots, 8)
    # the shrink's K splits combined through planes of partial sums or atomics, or the launcher's choice
    # (K splits with short last ranges are covered by the shrink tests above)
    kw = {} if partials is None else dict(split_k=3, partials=partials)
    got = lora_linear(x.to(DEV), W.to(DEV), A.to(DEV), B.to(DEV), segs, r_t.to(DEV), offs, **kw).cpu()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    base = token_slots < 0
    torch.testing.assert_close(got[base], (x[base].float() @ W.float().T).to(dtype), atol=atol, rtol=rtol)
    add_after = ref.lora_expand(x @ W.T, ref.lora_shrink(x, A, token_slots, r_t), B, token_slots, offs, r_t)
    torch.testing.assert_close(got, add_after, atol=atol, rtol=rtol)


def test_write_mode_refuses_segments_that_miss_rows() -> None:
    segs = sgmv_segments([2, 1], [0, -1], DEV)
    ranks = torch.tensor([4], dtype=torch.int32, device=DEV)
    h, B = torch.zeros(4, 1, 4, device=DEV), torch.zeros(1, 8, 4, device=DEV)
    y = torch.full((4, 8), 7.0, device=DEV)
    with pytest.raises(ValueError, match="cover every row"):
        lora_expand(y, h, B, segs, ranks, [0, 8], write=True)  # y has 4 rows, the step 3
    assert (y == 7).all()
    segs.base_rows = None
    with pytest.raises(ValueError, match="base_rows"):
        lora_expand(y[:3], h[:3], B, segs, ranks, [0, 8], write=True)
    with pytest.raises(ValueError, match="out must be"):
        lora_shrink(torch.zeros(3, 16, device=DEV), torch.zeros(1, 1, 4, 16, device=DEV), segs, ranks,
                    out=torch.zeros(3, 1, 4, device=DEV), partials=True)


def test_shrink_row_tiles_shrink_instead_of_splitting_atomically() -> None:
    # The launcher's choice (host ints only): an H200-sized GPU (132 SMs), one 4096-token segment.
    # gate_up_proj (N = 32): 128-row tiles give 32 programs, under a quarter of the SMs, so they would
    # split K atomically; 64-row tiles give 64 and run unsplit.
    from kernels.lora_shrink import _unsplit_block_m
    assert _unsplit_block_m(128, 1, 4096, 32, 132) == 64
    assert _unsplit_block_m(128, 1, 16384, 32, 132) == 128  # 128 programs: no split, tiles kept
    assert _unsplit_block_m(128, 4, 4096, 32, 132) == 128  # four segments: 128 programs
    assert _unsplit_block_m(128, 1, 1024, 32, 132) == 32  # never below 32 rows
    assert _unsplit_block_m(32, 1, 256, 48, 132) == 32


def test_shrink_sorted_decode_planes_cover_at_most_1024_of_k() -> None:
    # The launcher's plane count (host ints only). The decode graphs' sorted chunks, when the grid rule
    # splits: down_proj's K 14336 in 14 planes of 1024, K-4096 projections keep the grid rule's count;
    # never past MAX_PLANES; an unsplit grid and other layouts (prefill) as the grid rule set them.
    from kernels.lora_shrink import MAX_PLANES, _plane_count
    assert _plane_count(6, 14336, True) == 14
    assert _plane_count(6, 4096, True) == 6
    assert _plane_count(2, 4096, True) == 4
    assert _plane_count(6, 65536, True) == MAX_PLANES
    assert _plane_count(1, 14336, True) == 1
    assert _plane_count(6, 14336, False) == 6
    assert _plane_count(40, 4096, False) == MAX_PLANES
