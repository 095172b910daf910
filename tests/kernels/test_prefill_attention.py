"""The Triton prefill attention kernel against its torch twin (kernels/reference.py), and its tiles.

On CPU it runs in Triton's interpreter (tests/conftest.py), so the shapes are small. Sweeps: GQA ratios
1, 3, 4; head_dim 64 and 128; ragged steps of several chunks with and without a cached context, contexts
that are not multiples of the block size, q_len from 1 to more than a block and more than a tile;
tiles of 16 rows (many per chunk, a group that does not divide them) and the default 128;
fp32/bf16/fp16 with the decode tests' tolerance table. Every case poisons with NaN what must not be
read (the decode tests' cache: blocks no chunk owns, the slots past each chunk's last token, table
entries past its blocks), and the query rows of the step's decode tokens after the chunks.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.prefill_attention import prefill_attention
from kernels.prefill_tiles import prefill_tiles
from tests.kernels.test_paged_attention import BS, DEV, TOL
from tests.kernels.test_paged_attention import make_case as decode_case

# (context_len, q_len) per chunk: fresh prompts, a 1-token chunk, contexts off the block grid, a chunk
# longer than a block and than a 16-row tile.
RAGGED = [(0, 5), (21, 1), (16, 20), (0, 37), (35, 9)]


def make_case(num_heads: int, num_kv_heads: int, head_dim: int, chunks: list[tuple[int, int]],
              dtype: torch.dtype, decodes: int = 2, seed: int = 0):
    """(q, k_cache, v_cache, chunk tuples for prefill_tiles): the decode tests' poisoned cache holding
    each chunk's context_len + q_len positions, and the chunks' queries followed by NaN decode rows."""
    _, kc, vc, tables, _ = decode_case(num_heads, num_kv_heads, head_dim, [c + n for c, n in chunks], dtype, seed)
    out, q0 = [], 0
    for (c, n), table in zip(chunks, tables.tolist()):
        out.append((q0, n, c, table))  # entries past a chunk's blocks point at the NaN block
        q0 += n
    q = torch.randn(q0 + decodes, num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    q[q0:] = float("nan")  # the step's decode rows: not the kernel's
    return q.to(dtype).to(DEV), kc, vc, out


def run_both(q, kc, vc, chunks, scale, dtype, block_m=16, **kw):
    group = q.shape[1] // kc.shape[2]
    tiles = prefill_tiles(chunks, BS, group, DEV, block_m=block_m)
    got = prefill_attention(q, kc, vc, tiles, scale, **kw)
    tp = tiles.num_tokens
    want = ref.prefill_attention(q[:tp].float(), kc.float(), vc.float(), chunks, scale)
    assert got.shape == (tp, *q.shape[1:]) and got.dtype == dtype and not got.isnan().any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_gqa_and_head_dims_match_twin(heads: int, kv_heads: int, head_dim: int) -> None:
    q, kc, vc, chunks = make_case(heads, kv_heads, head_dim, RAGGED, torch.float32)
    run_both(q, kc, vc, chunks, head_dim ** -0.5, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_dtypes_match_twin(dtype: torch.dtype) -> None:
    q, kc, vc, chunks = make_case(6, 2, 64, RAGGED, dtype, seed=1)
    run_both(q, kc, vc, chunks, 0.125, dtype)


@pytest.mark.parametrize("block_n", [16, 32])
def test_prefill_default_tiles_and_key_blocks_match_twin(block_n: int) -> None:
    # 128-row tiles (the GPU's): one tile per chunk here; key blocks smaller than, and equal to, the
    # 32 keys a 33-token context fills without the mask, so both loops run.
    q, kc, vc, chunks = make_case(9, 3, 64, [(33, 12), (0, 3), (64, 40)], torch.float32, seed=2)
    run_both(q, kc, vc, chunks, 0.125, torch.float32, block_m=128, block_n=block_n)


def test_prefill_writes_only_the_chunks_rows_of_out() -> None:
    q, kc, vc, chunks = make_case(4, 2, 64, [(3, 4), (0, 6)], torch.float32, seed=3)
    tiles = prefill_tiles(chunks, BS, 2, DEV, block_m=16)
    full = torch.full_like(q, 7.0)
    got = prefill_attention(q, kc, vc, tiles, 0.125, out=full[:tiles.num_tokens])
    want = ref.prefill_attention(q[:10], kc, vc, chunks, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (full[10:] == 7.0).all()


def test_prefill_tiles_cut_chunks_and_put_the_longest_first() -> None:
    # group 3 in 16 rows: 5 tokens a tile (15 rows, one padding row)
    t = prefill_tiles([(0, 7, 0, [4, 9]), (7, 1, 40, [1, 2, 3, 5, 6]), (8, 5, 16, [8, 0])], BS, 3,
                      torch.device("cpu"), block_m=16)
    assert (t.num_tiles, t.num_tokens, t.group, t.block_m, t.tokens_per_tile) == (4, 13, 3, 16, 5)
    # (q row, tokens, position, table offset), longest K/V range (position + tokens) first
    assert t.tiles.tolist() == [[7, 1, 40, 1], [8, 5, 16, 4], [5, 2, 5, 0], [0, 5, 0, 0]]
    assert t.tables.tolist() == [4, 1, 2, 3, 8, 0]  # only the blocks each chunk reads
    wide = prefill_tiles([(0, 3, 0, [0])], BS, 32, torch.device("cpu"), block_m=16)
    assert (wide.block_m, wide.tokens_per_tile) == (32, 1)  # a group wider than the tile: one token
    with pytest.raises(ValueError, match="needs 2 blocks"):
        prefill_tiles([(0, 3, 15, [0])], BS, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="power of two"):
        prefill_tiles([], BS, 1, torch.device("cpu"), block_m=48)


def test_prefill_rejects_bad_inputs() -> None:
    q, kc, vc, chunks = make_case(4, 2, 64, [(0, 3)], torch.float32)
    tiles = prefill_tiles(chunks, BS, 2, DEV)
    with pytest.raises(ValueError, match="multiple"):
        prefill_attention(q[:, :3], kc, vc, tiles, 1.0)
    with pytest.raises(ValueError, match="tiles were cut"):
        prefill_attention(q[:, :2], kc, vc, tiles, 1.0)
    with pytest.raises(ValueError, match="share"):
        prefill_attention(q.half(), kc, vc, tiles, 1.0)
    with pytest.raises(ValueError, match="tiles cover"):
        prefill_attention(q[:2], kc, vc, tiles, 1.0)
    with pytest.raises(ValueError, match="block_n"):
        prefill_attention(q, kc, vc, tiles, 1.0, block_n=24)
    with pytest.raises(ValueError, match="out must"):
        prefill_attention(q, kc, vc, tiles, 1.0, out=torch.empty_like(q))
