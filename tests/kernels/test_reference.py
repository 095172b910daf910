"""The pure-torch LoRA ops against an explicit per-token loop, over how adapters spread across a batch."""

from __future__ import annotations

import pytest
import torch

from appliance.lora.batch import LoRABatchInfo
from kernels.reference import lora_apply_gathered, lora_apply_grouped, lora_expand, lora_shrink

SLICES = [24, 8, 8]  # a fused qkv-like projection
LAYOUTS = {  # (segment lengths, slot per segment; -1 = base)
    "distinct": ([3, 1, 4, 2], [0, 1, 2, 3]),
    "identical": ([2, 2, 2], [1, 1, 1]),
    "with_base": ([4, 1, 3, 1], [-1, 2, -1, 0]),
    "decode": ([1] * 8, [0, 3, -1, 1, 3, 2, -1, 0]),
    "all_base": ([2, 3], [-1, -1]),
}


def oracle(y, x, A, B, token_slots, off):
    y = y.clone()
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s < 0:
            continue
        for i in range(len(off) - 1):
            y[t, off[i]:off[i + 1]] += B[s, off[i]:off[i + 1]] @ (A[s, i] @ x[t])
    return y


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ops_match_per_token_loop(layout: str) -> None:
    torch.manual_seed(0)
    seg_lens, seg_slots = LAYOUTS[layout]
    S, R, d_in = 4, 8, 32
    off = [0]
    for n in SLICES:
        off.append(off[-1] + n)
    A = torch.randn(S, len(SLICES), R, d_in, dtype=torch.float64)
    B = torch.randn(S, off[-1], R, dtype=torch.float64)
    info = LoRABatchInfo.build(seg_lens, seg_slots, [R] * S, torch.device("cpu"))
    T = sum(seg_lens)
    x = torch.randn(T, d_in, dtype=torch.float64)
    y = torch.randn(T, off[-1], dtype=torch.float64)
    want = oracle(y, x, A, B, info.token_slots, off)
    h = lora_shrink(x, A, info.token_slots)
    torch.testing.assert_close(lora_expand(y.clone(), h, B, info.token_slots, off), want)
    torch.testing.assert_close(lora_apply_grouped(y.clone(), x, A, B, info.groups, off), want)
    torch.testing.assert_close(lora_apply_gathered(y.clone(), x, A, B, info.token_slots, off), want)
    assert info.gather == (len(info.groups) > 1)  # all layouts here are small steps
