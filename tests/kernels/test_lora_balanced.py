"""kernels/lora_balanced.py (lora_apply's one-slice decode delta, every program's share of the bytes equal) against
the torch twin, on CPU in Triton's interpreter (programs run one after another there: a consumer finds
its producers' flags raised, or, with publish off, recomputes their partials).

Shares shorter than a token (so it touches at most two): tokens cut in two, in three, one unit a program,
empty shares; both strategies' segments (csgmv gathers its rows), the static batch's slot -1 rows,
mixed ranks with poisoned rank padding, an empty slot, scalings.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as ref
from kernels.lora_apply import lora_apply
from kernels.lora_balanced import _WORKSPACE, launch_balanced
from kernels.segments import LoRASegments, csgmv_segments, sgmv_segments

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2)}
RANKS = [16, 8, 12, 0, 5]
K, OUT, R, BK = 80, 48, 16, 16  # A: 5 K tiles, B: 3 column tiles -> a token is 8 units


def case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = len(RANKS)
    A = (torch.randn(S, 1, R, K, generator=g) / math.sqrt(K)).to(dtype)
    B = (torch.randn(S, OUT, R, generator=g) / math.sqrt(R)).to(dtype)
    for s, r in enumerate(RANKS):
        A[s, :, r:] = 1000.0
        B[s, :, r:] = float("nan")
    return A, B, g


def segs_for(kind: str, slots: list[int]) -> LoRASegments:
    if kind == "triton":
        return sgmv_segments([1] * len(slots), slots, DEV)
    if kind == "csgmv":
        return csgmv_segments([1] * len(slots), slots, 1, DEV)
    # the static decode batch (engine/cuda_graph.py): one segment per row, base and padding rows at -1
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    return LoRASegments(starts=t(list(range(len(slots)))), lens=t([1] * len(slots)), slots=t(slots),
                        token_index=None, max_len=1, num_rows=len(slots))


@pytest.mark.parametrize("kind", ["triton", "csgmv", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_balanced_against_reference(kind: str, dtype: torch.dtype) -> None:
    if dtype == torch.float32 and DEV.type == "cuda":
        pytest.skip("the TMA bodies take bf16/fp16 on CUDA")
    slots = [0, -1, 1, 2, 4, 0, 3, -1, 1]
    if kind == "csgmv":
        slots = [s if s != 0 else 2 for s in slots]
    A, B, g = case(dtype)
    T = len(slots)
    x = torch.randn(T, K, generator=g).to(dtype)
    y0 = torch.randn(T, OUT, generator=g).to(dtype)
    scal = torch.rand(len(RANKS), generator=g) + 0.5 if dtype != torch.float32 else None
    ts = torch.tensor(slots)
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    want = ref.lora_expand(y0.clone(), ref.lora_shrink(x, A, ts, ranks), B, ts, [0, OUT], ranks, scal)
    segs = segs_for(kind, slots)
    tokens = segs.num_segs
    args = (x.to(DEV), A.to(DEV), B.to(DEV), segs, ranks.to(DEV), None if scal is None else scal.to(DEV))
    fused = y0.clone().to(DEV)
    lora_apply(fused, args[0], args[1], args[2], segs, args[4], [0, OUT], args[5], fused=True, tma=True,
               block_k=BK, block_n=BK, balanced=False)
    atol, rtol = TOL[dtype]
    # more programs than tokens: shares of 7 units (tokens of 8 cut in two), 4 (cut in two or three),
    # 1 unit a program, and more programs than units (empty shares)
    for programs in (tokens + 1, 2 * tokens, 8 * tokens, 8 * tokens + 5):
        outs = []
        for publish in (True, False):
            y = y0.clone().to(DEV)
            assert launch_balanced(y, *args, programs=programs, block_k=BK, publish=publish)
            outs.append(y.cpu())
            torch.testing.assert_close(outs[-1], want, atol=atol, rtol=rtol)
            base = ts < 0
            assert torch.equal(outs[-1][base], y0[base]), "base rows changed"
            assert int(_WORKSPACE[y.device][1].abs().sum()) == 0, "flags not left zero"
        assert torch.equal(outs[0], outs[1]), f"P={programs}: a recomputed partial gave other bits"
        torch.testing.assert_close(outs[0], fused.cpu(), atol=atol, rtol=rtol)
    # as many programs as tokens or fewer: not run (a share would hold more than two tokens)
    assert not launch_balanced(y0.clone().to(DEV), *args, programs=tokens, block_k=BK)


def test_balanced_through_lora_apply() -> None:
    # lora_apply(balanced=True) runs it for one slice (programs: P); more slices refuse it
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    A, B, g = case(dtype, seed=1)
    slots = [1, 2, 4, 0, 1, 2]
    x = torch.randn(6, K, generator=g).to(dtype)
    y0 = torch.randn(6, OUT, generator=g).to(dtype)
    ts = torch.tensor(slots)
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    want = ref.lora_expand(y0.clone(), ref.lora_shrink(x, A, ts, ranks), B, ts, [0, OUT], ranks)
    segs = segs_for("triton", slots)
    y = y0.clone().to(DEV)
    lora_apply(y, x.to(DEV), A.to(DEV), B.to(DEV), segs, ranks.to(DEV), [0, OUT], fused=True, tma=True,
               block_k=BK, block_n=BK, balanced=True, programs=7)
    torch.testing.assert_close(y.cpu(), want, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    A2 = A.view(len(RANKS), 1, R, K).expand(len(RANKS), 2, R, K).contiguous()
    B2 = torch.cat([B, B], dim=1)
    with pytest.raises(ValueError, match="one slice"):
        lora_apply(torch.zeros(6, 2 * OUT, dtype=dtype, device=DEV), x.to(DEV), A2.to(DEV), B2.to(DEV), segs,
                   ranks.to(DEV), [0, OUT, 2 * OUT], fused=True, tma=True, balanced=True)
