"""prefill_attention: causal attention of every prefill chunk of a step in one launch, K/V read from the paged cache.

    out[t, h] = softmax(scale * q[t, h] · K[c, :P_t + 1, h // G]ᵀ) @ V[c, :P_t + 1, h // G]

for each query row t of chunk c, at position P_t = context_len_c + t - q_start_c (causal, aligned to
the lower right), where K[c, p] = k_cache[table_c[p // BS], p % BS] and G = query heads per KV head.
This step's K/V are in the cache already (the model writes them before attention), so a chunk with
no context and one continuing a cached prefix (chunked prefill, a prefix-cache hit) are the same case.
A program takes one tile (kernels/prefill_tiles.py: up to tokens_per_tile tokens of one chunk, times
the G query heads of one KV head, as rows) and streams its chunk's K/V once for all rows, with the
online softmax of flash attention 2 in fp32: first the keys every row sees (no mask), then the
diagonal tiles under the causal mask. All per-step layout is in the tiles, read on the device; the
compile-time constants depend on the model only, so no step compiles a new variant.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_wait, pdl_launch
from kernels.online_softmax import LOG2E, online_softmax_step, tile_scores
from kernels.paged_attention import check_q_and_cache
from kernels.platform import dot_upcast, pdl_available
from kernels.prefill_tiles import PrefillTiles


@triton.jit
def _tile_step(acc, m_i, l_i, q, k_ptrs, v_ptrs, kv_mask, causal, qk_scale,
               UPCAST: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """Load one K/V tile, score it (log2 domain), mask it when MASKED: the updated acc, m_i, l_i."""
    if MASKED:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s, v = tile_scores(q, k, v, qk_scale, UPCAST, IEEE)  # s [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where(causal, s, float("-inf"))
    return online_softmax_step(acc, m_i, l_i, s, v, IEEE)


@triton.jit
def _prefill_attention_kernel(
    out_ptr,  # [Tp, H, D] output rows of the chunks' tokens
    q_ptr,  # [>= Tp, H, D] queries (rows may be strided: a view of the fused qkv output)
    k_ptr, v_ptr,  # [num_blocks, BS, KVH, D] this layer's cache, this step's K/V written already
    tiles_ptr,  # [N, 4] int32: q row of the tile's first token, its tokens, that token's position, table offset
    tables_ptr,  # [*] int32: the chunks' block tables back to back
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    KVH: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (PDL): q and this step's K/V are rope_write_kv's output
    pid = tl.program_id(0)
    tile = pid // KVH  # consecutive programs share a tile: the longest tiles' heads all start first
    kvh = pid % KVH
    q_row = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    ntok = tl.load(tiles_ptr + tile * 4 + 1)
    pos0 = tl.load(tiles_ptr + tile * 4 + 2)
    tbl = tables_ptr + tl.load(tiles_ptr + tile * 4 + 3)
    kv_end = pos0 + ntok  # keys [0, kv_end) are the chunk's context and its tokens up to this tile's last

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = offs_m // GROUP  # row -> (token of the tile, query head of the KV head)
    head = kvh * GROUP + offs_m % GROUP
    row_ok = tok < ntok
    d_mask = offs_d < D
    # Padding rows take the last token's position: they see keys < kv_end only, and are not stored.
    pos = pos0 + tl.minimum(tok, ntok - 1)  # [BLOCK_M]
    q_rows = (q_row + tok) * stride_qt + head * stride_qh  # [BLOCK_M] int64
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    k_head = k_ptr + kvh * stride_kh + offs_d[None, :]
    v_head = v_ptr + kvh * stride_vh + offs_d[None, :]
    # Keys [0, full) are seen by every row (the tile's first token is at pos0): no mask. With
    # BLOCK_D > D the d mask is still needed, so the unmasked loop only runs when BLOCK_D == D.
    full = (pos0 + 1) // BLOCK_N * BLOCK_N
    if BLOCK_D != D:
        full = 0
    for start in range(0, full, BLOCK_N):
        kp = start + offs_n
        blk = tl.load(tbl + kp // BS).to(tl.int64)
        off = kp % BS
        acc, m_i, l_i = _tile_step(acc, m_i, l_i, q,
                                   k_head + blk[:, None] * stride_kb + off[:, None] * stride_ks,
                                   v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs,
                                   None, None, qk_scale, UPCAST, IEEE, False)
    for start in range(full, kv_end, BLOCK_N):
        kp = start + offs_n
        n_ok = kp < kv_end
        blk = tl.load(tbl + kp // BS, mask=n_ok, other=0).to(tl.int64)
        off = kp % BS
        acc, m_i, l_i = _tile_step(acc, m_i, l_i, q,
                                   k_head + blk[:, None] * stride_kb + off[:, None] * stride_ks,
                                   v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs,
                                   n_ok[:, None] & d_mask[None, :], kp[None, :] <= pos[:, None],
                                   qk_scale, UPCAST, IEEE, True)
    o = acc / l_i[:, None]  # every row saw key 0 at least: l_i > 0
    o_rows = (q_row + tok) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: PrefillTiles,
                      scale: float, out: Optional[torch.Tensor] = None, block_n: Optional[int] = None,
                      num_warps: Optional[int] = None, num_stages: Optional[int] = None) -> torch.Tensor:
    """out[t, h] = softmax(scale * q[t, h] · K[c, :P_t + 1, h // G]ᵀ) @ V[c, :P_t + 1, h // G] for the
    rows t of every chunk c in `tiles` (P_t: t's position; K/V through c's block table).

    q [>= Tp, H, D] (Tp = tiles.num_tokens; rows past Tp are not read; head_dim contiguous);
    k_cache, v_cache [num_blocks, BS, KVH, D] (H = G * KVH, G = tiles.group), q's dtype (fp32, bf16
    or fp16); out [Tp, H, D] (default: allocated; rows in no chunk are left as they are).
    block_n, num_warps, num_stages: the tile shape (default: by head_dim and dtype). Returns out.
    """
    check_q_and_cache("prefill_attention", q, k_cache, v_cache)
    T, H, D = q.shape
    _, BS, KVH, _ = k_cache.shape
    if H != tiles.group * KVH:
        raise ValueError(f"prefill_attention: {H} query heads, the tiles were cut for {tiles.group} per "
                         f"KV head x {KVH}")
    if tiles.num_tokens > T:
        raise ValueError(f"prefill_attention: the tiles cover {tiles.num_tokens} rows, q has {T}")
    for name, t in (("tiles", tiles.tiles), ("tables", tiles.tables)):
        if t.device != q.device or t.dtype != torch.int32:
            raise ValueError(f"prefill_attention: {name} must be int32 on {q.device}, got {t.dtype} on {t.device}")
    if out is None:
        out = torch.empty(tiles.num_tokens, H, D, dtype=q.dtype, device=q.device)
    elif out.shape != (tiles.num_tokens, H, D) or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"prefill_attention: out must be [{tiles.num_tokens}, {H}, {D}] {q.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if tiles.num_tiles == 0:
        return out
    block_d = max(16, triton.next_power_of_2(D))
    fp32 = q.dtype == torch.float32
    if block_n is None:
        block_n = 32 if fp32 or block_d > 128 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"prefill_attention: block_n must be a power of two >= 16, got {block_n}")
    pdl = pdl_available(q.device)  # a programmatic dependent of the kernel before it (kernels/gdc.py)
    _prefill_attention_kernel[(tiles.num_tiles * KVH,)](
        out, q, k_cache, v_cache, tiles.tiles, tiles.tables, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KVH=KVH, GROUP=tiles.group, D=D, BLOCK_D=block_d, BS=BS, BLOCK_M=tiles.block_m, BLOCK_N=block_n,
        UPCAST=dot_upcast(q.dtype), IEEE=dot_upcast(q.dtype) or fp32,
        num_warps=num_warps or (8 if tiles.block_m >= 128 else 4), num_stages=num_stages or 2, **pdl_launch(pdl))
    return out
