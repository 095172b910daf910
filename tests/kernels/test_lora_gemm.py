"""lora_gemm (the base GEMM with the multi-LoRA delta in its epilogue) against the torch twin.

Runs compiled on a GPU, under Triton's interpreter on CPU (tests/conftest.py). Row tiles of 32 rows
(the CPU tiles) cut across segments of different adapters, base rows and the matrix's edge, so the
epilogue's walk over a tile's distinct slots, its masks and the wrapped edge loads are all exercised.
Rank padding of A and B and every slot no token uses are NaN: a read of them shows as a mismatch; y
is fresh memory the kernel must fill (torch.empty), checked for NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as ref
from kernels.lora_gemm import GemmTiles, block_n_for, lora_gemm, unfit_reason
from kernels.lora_shrink import lora_shrink
from kernels.segments import csgmv_segments, sgmv_segments

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 2e-2)}


def interpreter_fp32() -> None:
    """The fp32 cases are the interpreter's (CI's): on a CUDA device lora_gemm refuses fp32 by design
    (kernels/lora_gemm.unfit_reason), so a GPU run of this file skips them."""
    if DEV.type == "cuda":
        pytest.skip("lora_gemm refuses fp32 on CUDA; the bf16/fp16 cases run there")


def case(dtype: torch.dtype, lens: list[int], slots: list[int], ranks: list[int], K: int, slices: list[int],
         R: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    S, T, N, n = len(ranks), sum(lens), sum(slices), len(slices)
    A = (torch.randn(S, n, R, K, generator=g) / math.sqrt(K)).to(dtype)
    B = (torch.randn(S, N, R, generator=g) / math.sqrt(R)).to(dtype)
    used = {s for s in slots if s >= 0}
    for s, r in enumerate(ranks):
        A[s, :, r:] = float("nan")
        B[s, :, r:] = float("nan")
        if s not in used:
            A[s] = float("nan")
            B[s] = float("nan")
    x = torch.randn(T, K, generator=g).to(dtype)
    W = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype)
    offs = [0]
    for s in slices:
        offs.append(offs[-1] + s)
    token_slots = torch.tensor([s for n_, s in zip(lens, slots) for _ in range(n_)])
    return x, W, A, B, offs, token_slots, torch.tensor(ranks, dtype=torch.int32)


def run(strategy: str, x, W, A, B, offs, token_slots, ranks, lens, slots, scalings=None, tiles=None,
        fused: bool = True, **kw) -> torch.Tensor:
    """fused: the shrink as tiles of lora_gemm's own grid; else lora_shrink's h (kw: its options)."""
    segs = (sgmv_segments(lens, slots, DEV) if strategy == "triton" else csgmv_segments(lens, slots, 8, DEV))
    d = [t.to(DEV) for t in (x, W, A, B, ranks)]
    row_slots = token_slots.to(torch.int32).to(DEV)
    assert torch.equal(segs.row_slots.cpu(), row_slots.cpu())
    sc = None if scalings is None else scalings.to(DEV)
    if fused:
        return lora_gemm(d[0], d[1], None, d[3], segs.row_slots, d[4], offs, sc, A=d[2], tiles=tiles).cpu()
    h = lora_shrink(d[0], d[2], segs, d[4], **kw)
    return lora_gemm(d[0], d[1], h, d[3], segs.row_slots, d[4], offs, sc, tiles=tiles).cpu()


def want(x, W, A, B, offs, token_slots, ranks, scalings=None) -> torch.Tensor:
    acc = torch.float64
    Bs = B if scalings is None else (B.double() * scalings.double()[:, None, None])
    h = ref.lora_shrink(x.to(acc), A.to(acc), token_slots, ranks)
    y = (x.to(acc) @ W.to(acc).T)
    return ref.lora_expand(y, h, Bs.to(acc), token_slots, offs, ranks)


@pytest.mark.parametrize("shrink", ["fused", "given"])
@pytest.mark.parametrize("grid", ["tiles", "persistent"])
@pytest.mark.parametrize("strategy", ["triton", "csgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_against_reference(dtype: torch.dtype, strategy: str, grid: str, shrink: str) -> None:
    if dtype == torch.float32:
        interpreter_fp32()
    # 77 rows: segments of three adapters and base rows cut across 32-row tiles, a ragged last tile;
    # qkv-like slices (32 + 16 + 16 columns), mixed ranks (16, 5, 1), one slot unused (NaN). K = 40
    # is not a multiple of the 32-wide K step (the copy engine zero-fills past the edge). "persistent":
    # 4 programs walk the 12 tiles (with the shrink fused, the interpreter runs one tile a program:
    # see lora_gemm). "fused": the shrink as tiles of the same grid; "given": lora_shrink's h.
    lens, slots, ranks = [20, 9, 3, 30, 15], [0, 2, -1, 1, 0], [16, 5, 1, 8]
    x, W, A, B, offs, ts, r = case(dtype, lens, slots, ranks, 40, [32, 16, 16], 16)
    tiles = None if grid == "tiles" or DEV.type == "cuda" else \
        GemmTiles(32, 32, 32, num_warps=4, num_stages=1, group_m=2, persistent=True, shrink_stages=1)
    got = run(strategy, x, W, A, B, offs, ts, r, lens, slots, tiles=tiles, fused=shrink == "fused")
    assert not got.isnan().any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want(x, W, A, B, offs, ts, r), atol=atol, rtol=rtol)
    base = ts < 0
    torch.testing.assert_close(got[base].double(), x[base].double() @ W.double().T, atol=atol, rtol=rtol)


def test_scalings_planes_and_rank_64() -> None:
    # Scalings per slot, the shrink's K splits in planes (summed in the epilogue), rank 64, one slice
    # whose width is not a multiple of the tile (edge columns wrap on load, masked on store).
    interpreter_fp32()
    lens, slots, ranks = [33, 7, 24], [1, -1, 0], [64, 3]
    x, W, A, B, offs, ts, r = case(torch.float32, lens, slots, ranks, 48, [40], 64, seed=1)
    sc = torch.tensor([0.5, 2.0])
    got = run("triton", x, W, A, B, offs, ts, r, lens, slots, scalings=sc, fused=False, split_k=3, partials=True)
    torch.testing.assert_close(got.double(), want(x, W, A, B, offs, ts, r, sc), atol=1e-4, rtol=1e-4)
    got = run("triton", x, W, A, B, offs, ts, r, lens, slots, scalings=sc)
    torch.testing.assert_close(got.double(), want(x, W, A, B, offs, ts, r, sc), atol=1e-4, rtol=1e-4)


def test_the_waits_way_out_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # With SPIN_LIMIT 0 no tile waits for its row tile's column tile 0: each adapter tile computes that
    # row tile's h itself (the way out of a wait that lasts too long), overwriting the h its column tile
    # 0 stored (the interpreter runs tiles in order), and must still write the same bits. (A way out
    # that computed other bits fails here; one that were missing cannot, in the interpreter's order.)
    import kernels.lora_gemm as lg

    lens, slots, ranks = [20, 9, 3, 30, 15], [0, 2, -1, 1, 0], [16, 5, 1, 8]
    x, W, A, B, offs, ts, r = case(torch.bfloat16, lens, slots, ranks, 40, [32, 16, 16], 16, seed=3)
    tiles = GemmTiles(32, 32, 32, num_warps=4, num_stages=1, group_m=2, persistent=False) if DEV.type == "cpu" \
        else lg.device_tiles(DEV).gemm_default
    got = run("triton", x, W, A, B, offs, ts, r, lens, slots, tiles=tiles)
    torch.testing.assert_close(got.double(), want(x, W, A, B, offs, ts, r), atol=3e-2, rtol=2e-2)
    monkeypatch.setattr(lg, "SPIN_LIMIT", 0)
    alone = run("triton", x, W, A, B, offs, ts, r, lens, slots, tiles=tiles)
    assert torch.equal(alone, got)


def test_all_base_rows_is_the_plain_gemm() -> None:
    interpreter_fp32()
    lens, slots, ranks = [10, 5], [-1, -1], [16]
    x, W, A, B, offs, ts, r = case(torch.float32, lens, slots, ranks, 24, [16, 16], 16, seed=2)
    h = torch.full((15, 2, 16), float("nan"))  # never read: no row has a slot
    got = lora_gemm(x.to(DEV), W.to(DEV), h.to(DEV), B.to(DEV), ts.to(torch.int32).to(DEV), r.to(DEV), offs).cpu()
    torch.testing.assert_close(got, x @ W.T, atol=1e-4, rtol=1e-4)


def test_block_n_divides_slice_boundaries() -> None:
    assert block_n_for([0, 4096, 5120, 6144], 256) == 256
    assert block_n_for([0, 14336, 28672], 256) == 256
    assert block_n_for([0, 576, 768, 960], 256) == 64
    assert block_n_for([0, 40, 48], 256) == 0
    assert block_n_for([0, 4096], 256) == 256


def test_refuses_bad_arguments() -> None:
    x, W, A, B, offs, ts, r = case(torch.float32, [4], [0], [16], 16, [16, 16], 16)
    h = torch.zeros(4, 2, 16)
    rs = ts.to(torch.int32)
    with pytest.raises(ValueError, match="share"):
        lora_gemm(x, W.double(), h, B, rs, r, offs)
    with pytest.raises(ValueError, match="h must be fp32"):
        lora_gemm(x, W, h[:, :1], B, rs, r, offs)
    with pytest.raises(ValueError, match="row_slots"):
        lora_gemm(x, W, h, B, ts, r, offs)  # int64
    with pytest.raises(ValueError, match="out_offsets"):
        lora_gemm(x, W, h, B, rs, r, [0, 16])
    with pytest.raises(ValueError, match="column tile"):
        lora_gemm(x, W, h, B, rs, r, [0, 8, 32])
    xs = torch.randn(4, 20).to(torch.bfloat16)[:, :16]  # rows 40 bytes apart: not for the copy engine
    assert "16-byte" in unfit_reason(xs, W.to(torch.bfloat16), offs)
    assert unfit_reason(x, W, offs) is None


def test_lora_linear_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    # lora_linear's two prefill paths on one step (both strategies' segments): the Triton GEMM with the
    # delta in its epilogue against the cuBLAS order; a Triton GEMM asked for by name that runs out of
    # shared memory raises (the automatic fallback is the backend's: tests/lora/backend/test_policy.py).
    import triton

    import kernels.lora_linear as ll

    interpreter_fp32()
    lens, slots, ranks = [20, 9, 3, 30, 15], [0, 2, -1, 1, 0], [16, 5, 1, 8]
    x, W, A, B, offs, ts, r = case(torch.float32, lens, slots, ranks, 40, [32, 16, 16], 16, seed=4)
    d = [t.to(DEV) for t in (x, W, A, B, r)]
    for strategy in ("triton", "csgmv"):
        segs = sgmv_segments(lens, slots, DEV) if strategy == "triton" else csgmv_segments(lens, slots, 8, DEV)
        tri = ll.lora_linear(*d[:4], segs, d[4], offs, gemm="triton").cpu()
        cub = ll.lora_linear(*d[:4], segs, d[4], offs, gemm="cublas").cpu()
        torch.testing.assert_close(tri, cub, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tri.double(), want(x, W, A, B, offs, ts, r), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="gemm must be"):
        ll.lora_linear(*d[:4], segs, d[4], offs, gemm="cutlass")

    def out_of_smem(*a, **k):
        raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(ll, "lora_gemm", out_of_smem)
    with pytest.raises(triton.runtime.errors.OutOfResources):
        ll.lora_linear(*d[:4], segs, d[4], offs, gemm="triton")  # asked for by name: the error stands


def test_unfit_without_host_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    # An older triton (no triton.tools.tensor_descriptor): lora_gemm says why, so the backend's automatic
    # choice keeps the cuBLAS order instead of failing a step.
    import kernels.lora_gemm as lg

    x, W, A, B, offs, ts, r = case(torch.float32, [4], [0], [16], 16, [16, 16], 16)
    monkeypatch.setattr(lg, "descriptors_available", lambda: False)
    assert "TMA descriptors" in lg.unfit_reason(x, W, offs)


def test_compile_time_constants_do_not_follow_the_token_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every new set of constexprs is a compile (seconds on a GPU) in the middle of serving: off the
    persistent grid, 130 and 1000 tokens (neither divisible by 16) must launch the same variant."""
    import kernels.lora_gemm as lg

    seen: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append({k: v for k, v in kw.items() if k.isupper()})

    monkeypatch.setattr(lg, "_lora_gemm_kernel", Recorder())
    for T in (130, 1000):
        x, W, A, B, offs, token_slots, ranks = case(torch.float32, [T - 30, 30], [0, -1], [8], 64, [32], 8)
        run("triton", x, W, A, B, offs, token_slots, ranks, [T - 30, 30], [0, -1],
            tiles=GemmTiles(32, 32, 32, num_warps=4, num_stages=1, group_m=2, persistent=False))
    assert len(seen) == 2 and seen[0] == seen[1], seen
