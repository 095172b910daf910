"""kernels/rms_norm_lora.py: a one-slice projection's LoRA expand inside the add + RMSNorm after it.

Checked against the two kernels it replaces (lora_expand in add mode on a copy of x over one-token
segments, then rms_norm) and against the torch twin: with and without a residual, h in one plane and
in K-split planes, rows of slot -1 and of an empty slot (no delta), mixed ranks with NaN in B's rank
padding (must never be read), hidden sizes below one column step and over several (the last partial).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.rms_norm import rms_norm
from kernels.rms_norm_lora import rms_norm_lora
from kernels.segments import LoRASegments

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (0.1, 5e-2)}
S, R, K = 4, 16, 48
RANKS = [16, 8, 0, 4]  # slot 2 empty
SLOTS = [0, -1, 1, 0, 3, 2, -1, 1, 3, 0]


def operands(dtype: torch.dtype, H: int, split: int):
    g = torch.Generator().manual_seed(H + split)
    A = torch.randn(S, 1, R, K, generator=g) * 0.3
    B = torch.randn(S, H, R, generator=g) * 0.3
    for s, r in enumerate(RANKS):
        A[s, :, r:] = 0.0
        B[s, :, r:] = float("nan")  # rank padding: masked, must not leak
    A, B = A.to(dtype).to(DEV), B.to(dtype).to(DEV)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=DEV)
    T = len(SLOTS)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEV)
    # the static decode batch's layout: one segment per row, base rows at slot -1
    segs = LoRASegments(torch.arange(T, dtype=torch.int32, device=DEV), torch.ones(T, dtype=torch.int32, device=DEV),
                        slots, None, 1)
    xin = (torch.randn(T, K, generator=g)).to(dtype).to(DEV)
    h = lora_shrink(xin, A, segs, ranks, split_k=split, partials=True, block_k=16)
    x = (torch.randn(T, H, generator=g) * 2).to(dtype).to(DEV)
    res = (torch.randn(T, H, generator=g)).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEV)
    return x, res, w, h, B, slots, ranks, segs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [96, 1100])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("with_res", [True, False], ids=["residual", "no-residual"])
def test_equals_expand_then_rms_norm(dtype: torch.dtype, H: int, split: int, with_res: bool) -> None:
    x, res, w, h, B, slots, ranks, segs = operands(dtype, H, split)
    before = x.clone()
    residual = res if with_res else None
    out, s = rms_norm_lora(x, w, 1e-5, residual, h, B, slots, ranks)
    assert not out.isnan().any() and not s.isnan().any(), "an element was not written (or B's padding leaked)"
    assert torch.equal(x, before), "x must be left as it was"
    y = lora_expand(x.clone(), h, B, segs, ranks, [0, H])
    want_out, want_s = rms_norm(y, w, 1e-5, residual)
    # the same products and fp32 sums as lora_expand's one-token body; a GPU may order the 16-term sum
    # differently, so within one rounding of the dtype rather than bit for bit
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (1.6e-2, 8e-3)
    torch.testing.assert_close(s.float(), want_s.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(out.float(), want_out.float(), atol=atol * 4, rtol=rtol)
    twin_out, twin_s = ref.rms_norm_lora(x, w, 1e-5, residual, h, B.nan_to_num(0.0), slots.long(), ranks)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), twin_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(s.float(), twin_s.float(), atol=atol, rtol=rtol)
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (1.6e-2, 8e-3)
    # rows without a delta (slot -1, the empty slot 2): s is rms_norm's exactly; out up to the order of
    # the sum of squares (here in BLOCK_N-column steps, there the whole row at once)
    plain_out, plain_s = rms_norm(x, w, 1e-5, residual)
    none = [i for i, sl in enumerate(SLOTS) if sl < 0 or RANKS[sl] == 0]
    assert torch.equal(s[none], plain_s[none])
    torch.testing.assert_close(out[none].float(), plain_out[none].float(), atol=atol, rtol=rtol)


def test_refuses_bad_arguments() -> None:
    x, res, w, h, B, slots, ranks, _ = operands(torch.float32, 96, 1)
    with pytest.raises(ValueError, match="shapes disagree"):
        rms_norm_lora(x, w, 1e-5, res, h, B[:, :48], slots, ranks)  # B for another width
    with pytest.raises(ValueError, match="int32"):
        rms_norm_lora(x, w, 1e-5, res, h, B, slots.long(), ranks)
    with pytest.raises(ValueError, match="share one of"):
        rms_norm_lora(x, w.half(), 1e-5, res, h, B, slots, ranks)
    with pytest.raises(ValueError, match="fp32"):
        rms_norm_lora(x, w, 1e-5, res, h.half(), B, slots, ranks)
