"""Prefill chunks that continue a cached context, batched per group, against a naive softmax oracle; backend
triton's one prefill kernel launch against backend torch."""

from __future__ import annotations

import pytest
import torch

from appliance.models import attention
from appliance.models.attention import AttentionMetadata, PrefillSeq, context_groups, paged_attention


def _naive(q, k_cache, v_cache, table, ctx, n, scale):
    """Each query of a chunk over its sequence's K/V up to its own position, softmax written out."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    total = ctx + n
    kc = torch.cat([k_cache[b] for b in table])[:total]  # [total, kvh, d]
    vc = torch.cat([v_cache[b] for b in table])[:total]
    grp = q.shape[1] // kvh
    kc, vc = kc.repeat_interleave(grp, dim=1), vc.repeat_interleave(grp, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kc) * scale
    pos = ctx + torch.arange(n)[:, None]
    s = s.masked_fill(torch.arange(total)[None] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vc)


def _step(chunks, bs=4, kvh=2, h=6, d=8, blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(blocks, bs, kvh, d, generator=g)
    v_cache = torch.randn(blocks, bs, kvh, d, generator=g)
    free = list(torch.randperm(blocks, generator=g).tolist())
    prefills, q0 = [], 0
    for ctx, n in chunks:
        table = [free.pop() for _ in range((ctx + n + bs - 1) // bs)]
        prefills.append((q0, n, ctx, table))
        q0 += n
    q = torch.randn(q0, h, d, generator=g)
    return q, k_cache, v_cache, prefills


def _meta(prefills, groups):
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        prefills=[PrefillSeq(q0, n, c, torch.tensor(t)) for q0, n, c, t in prefills],
        num_prefill_tokens=sum(p[1] for p in prefills), decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_context_lens=torch.zeros(0, dtype=torch.long), decode_max_len=0, context_groups=groups)


def test_batched_context_chunks_match_the_naive_oracle_and_the_chunk_by_chunk_path(monkeypatch) -> None:
    # Fresh prompts, hits of several lengths, a one-token chunk, a context that ends mid-block.
    chunks = [(0, 5), (8, 3), (12, 4), (0, 7), (3, 1), (21, 6), (16, 16)]
    q, kc, vc, prefills = _step(chunks)
    monkeypatch.setattr(attention, "CONTEXT_GROUP_POSITIONS", 60)  # several groups
    groups = context_groups(prefills, kc.shape[1], torch.device("cpu"))
    assert len(groups) >= 2 and sum(int(g.valid.sum()) for g in groups) == sum(n for _, n, c, _ in prefills if c)
    k, v = torch.randn(q.shape[0], kc.shape[2], kc.shape[3]), torch.randn(q.shape[0], kc.shape[2], kc.shape[3])
    batched = paged_attention(q, k, v, kc, vc, _meta(prefills, groups), 0.3)
    one_by_one = paged_attention(q, k, v, kc, vc, _meta(prefills, []), 0.3)
    for q0, n, c, t in prefills:
        want = _naive(q[q0:q0 + n], kc, vc, t, c, n, 0.3) if c else one_by_one[q0:q0 + n]
        torch.testing.assert_close(batched[q0:q0 + n], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(one_by_one[q0:q0 + n], want, atol=1e-5, rtol=1e-5)


def test_a_lone_context_chunk_is_not_grouped(monkeypatch) -> None:
    _, kc, _, prefills = _step([(0, 5), (8, 3)])
    assert context_groups(prefills, kc.shape[1], torch.device("cpu")) == []
    # Nor are long chunks: with two short ones beside them, only the short ones form a group.
    monkeypatch.setattr(attention, "CONTEXT_GROUP_MAX_Q", 4)
    chunks = [(8, 3), (4, 9), (12, 2), (0, 6)]
    q, kc, vc, prefills = _step(chunks)
    groups = context_groups(prefills, kc.shape[1], torch.device("cpu"))
    assert len(groups) == 1 and int(groups[0].valid.sum()) == 5
    k, v = torch.randn(q.shape[0], kc.shape[2], kc.shape[3]), torch.randn(q.shape[0], kc.shape[2], kc.shape[3])
    got = paged_attention(q, k, v, kc, vc, _meta(prefills, groups), 0.3)
    for q0, n, c, t in prefills:
        if c:
            torch.testing.assert_close(got[q0:q0 + n], _naive(q[q0:q0 + n], kc, vc, t, c, n, 0.3), atol=1e-5, rtol=1e-5)


def test_backend_triton_runs_every_chunk_in_the_kernel_and_matches_torch() -> None:
    # Backend triton (the prefill kernel in the interpreter, then the decode kernel) against backend torch
    # on one mixed step: fresh prompts, context chunks, a 1-token chunk, then two decode rows.
    from kernels.prefill_tiles import prefill_tiles

    chunks = [(0, 5), (8, 3), (0, 9), (3, 1), (21, 6)]
    q, kc, vc, prefills = _step(chunks)
    tp = q.shape[0]
    g = torch.Generator().manual_seed(1)
    q = torch.cat([q, torch.randn(2, *q.shape[1:], generator=g)])
    k = torch.randn(tp + 2, kc.shape[2], kc.shape[3], generator=g)
    v = torch.randn(tp + 2, kc.shape[2], kc.shape[3], generator=g)
    for q0, n, c, t in prefills:  # this step's K/V are in the cache already, as the model writes them first
        for i in range(n):
            kc[t[(c + i) // 4], (c + i) % 4] = k[q0 + i]
            vc[t[(c + i) // 4], (c + i) % 4] = v[q0 + i]
    dec = dict(decode_block_tables=torch.tensor([[1, 2, 3], [4, 5, 0]]), decode_context_lens=torch.tensor([11, 6]),
               decode_max_len=11)

    def meta(backend: str, tiles=None, groups=()):
        m = _meta(prefills, list(groups))
        m.decode_block_tables, m.decode_context_lens, m.decode_max_len = dec.values()
        m.attention_backend, m.prefill_tiles = backend, tiles
        return m

    want = paged_attention(q, k, v, kc, vc, meta("torch", groups=context_groups(prefills, 4, q.device)), 0.3)
    tiles = prefill_tiles(prefills, 4, 3, q.device)
    assert tiles.num_tiles == 5 and tiles.num_tokens == tp
    got = paged_attention(q, k, v, kc, vc, meta("triton", tiles), 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert prefill_tiles([], 4, 3, q.device).num_tiles == 0
    # backend triton without tiles (engine.prefill_attention_kernel false): SDPA prefills, the decode kernel
    got = paged_attention(q, k, v, kc, vc, meta("triton", groups=context_groups(prefills, 4, q.device)), 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
