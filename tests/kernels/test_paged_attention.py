"""The Triton paged-attention decode kernel against its torch twin (kernels/reference.py).

On CPU it runs in Triton's interpreter (tests/conftest.py), so the shapes are small. Sweeps: GQA ratios
1, 3, 4; head_dim 64 and 128; context lengths that are not multiples of the block size (1 token, a
block and one, several blocks); fp32/bf16/fp16 with a tolerance table; split-K 1 and 3. Every case
poisons with NaN what must not be read: blocks no sequence owns, the slots past each context in its
last block, and the block-table entries past each sequence's blocks (pointing at a NaN block).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.paged_attention import paged_attention_decode

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {  # dtype -> (atol, rtol) against the twin in fp32 on the same rounded inputs
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
BS = 16


def make_case(num_heads: int, num_kv_heads: int, head_dim: int, ctx_lens: list[int], dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    need = [(c + BS - 1) // BS for c in ctx_lens]
    max_blocks = max(need) + 1  # one more column than anyone needs: it must not be read
    num_blocks = sum(need) + 3
    kc = torch.randn(num_blocks, BS, num_kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks, BS, num_kv_heads, head_dim, generator=g)
    poison = num_blocks - 1  # a block nobody owns, all NaN
    kc[poison] = float("nan")
    vc[poison] = float("nan")
    order = torch.randperm(num_blocks - 1, generator=g).tolist()  # blocks scattered over the cache
    tables = torch.full((len(ctx_lens), max_blocks), poison, dtype=torch.int32)
    o = 0
    for b, (c, n) in enumerate(zip(ctx_lens, need)):
        blocks = order[o:o + n]
        o += n
        tables[b, :n] = torch.tensor(blocks, dtype=torch.int32)
        tail = c - (n - 1) * BS  # tokens used in the last block
        kc[blocks[-1], tail:] = float("nan")
        vc[blocks[-1], tail:] = float("nan")
    q = torch.randn(len(ctx_lens), num_heads, head_dim, generator=g)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return (q.to(dtype).to(DEV), kc.to(dtype).to(DEV), vc.to(dtype).to(DEV), tables.to(DEV), lens.to(DEV))


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_decode_gqa_and_head_dims_match_twin(heads: int, kv_heads: int, head_dim: int) -> None:
    q, kc, vc, bt, lens = make_case(heads, kv_heads, head_dim, [1, 17, 40], torch.float32)
    scale = head_dim ** -0.5
    got = paged_attention_decode(q, kc, vc, bt, lens, scale)
    want = ref.paged_attention_decode(q, kc, vc, bt, lens, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_dtypes_and_split_k_match_twin(dtype: torch.dtype, splits: int) -> None:
    q, kc, vc, bt, lens = make_case(6, 2, 64, [33, 5, 70, 16], dtype, seed=1)
    scale = 0.125
    got = paged_attention_decode(q, kc, vc, bt, lens, scale, num_splits=splits)
    want = ref.paged_attention_decode(q.float(), kc.float(), vc.float(), bt, lens, scale)
    assert got.dtype == dtype and not got.isnan().any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_paged_decode_padding_rows_give_zero_and_long_tables_are_not_read() -> None:
    # A static decode batch pads with context length 0 rows; their table row points at NaN blocks.
    q, kc, vc, bt, lens = make_case(4, 2, 64, [20, 3], torch.float32, seed=2)
    lens = torch.cat([lens, torch.zeros(2, dtype=lens.dtype, device=DEV)])
    bt = torch.cat([bt, torch.full((2, bt.shape[1]), int(bt.max()), dtype=bt.dtype, device=DEV)])
    q = torch.cat([q, torch.randn(2, *q.shape[1:], device=DEV)])
    out = torch.full_like(q, float("nan"))  # poisoned output: every row must be written
    got = paged_attention_decode(q, kc, vc, bt, lens, 0.125, out=out, num_splits=2, max_len_bound=64)
    want = ref.paged_attention_decode(q, kc, vc, bt, lens, 0.125)
    assert got is out and not got.isnan().any()
    assert (got[2:] == 0).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paged_decode_rejects_bad_inputs() -> None:
    q, kc, vc, bt, lens = make_case(4, 2, 64, [5], torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(q[:, :3], kc, vc, bt, lens, 1.0)
    with pytest.raises(ValueError, match="share"):
        paged_attention_decode(q.half(), kc, vc, bt, lens, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode(q, kc, vc, bt, lens.float(), 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode(q, kc, vc, bt, lens, 1.0, num_splits=0)
