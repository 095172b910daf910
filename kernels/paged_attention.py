"""paged_attention_decode: one query token per sequence against its paged K/V cache, GQA-aware.

    out[b, h] = softmax(scale * q[b, h] · K[b, :L_b, h // G]ᵀ) @ V[b, :L_b, h // G],   L_b = context_lens[b]

where K[b, p] = k_cache[block_tables[b, p // BS], p % BS] and G = query heads per KV head. A program
takes one sequence, one KV head and one split of its context, streaming K/V once for its G query heads
(online softmax in fp32). Lengths are read on the device, so one launch serves every CUDA-graph replay.
With few sequences each context is cut into `num_splits` parts (flash-decoding) merged by a torch
combine; the count is a grid axis, not a constexpr, so a longer context never compiles a new kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_wait, pdl_launch
from kernels.online_softmax import LOG2E, online_softmax_step, tile_scores
from kernels.platform import dot_upcast, pdl_available


# stride_btb (the block table's row length) changes with the step's longest context in eager steps:
# not specialized on its value, so no step pays a first-seen compile for it (engine/warmup.py).
@triton.jit(do_not_specialize=["stride_btb"])
def _paged_decode_kernel(
    out_ptr,  # [B, H, D] output (not SPLIT) or [B, H, S, D] fp32 partial acc
    m_ptr, l_ptr,  # [B, H, S] fp32 running max / sum of each split (SPLIT only; S = grid axis 2)
    q_ptr,  # [B, H, D]
    k_ptr, v_ptr,  # [num_blocks, BS, KVH, D]
    bt_ptr,  # [B, max_blocks] int32/int64 block table
    ctx_ptr,  # [B] int context length (tokens in the cache, this step's included)
    qk_scale, part_len,  # softmax scale * log2(e); tokens per split (a multiple of BLOCK_N)
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (PDL): q and this step's K/V are rope_write_kv's output
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    lo = split * part_len
    hi = tl.minimum(lo + part_len, ctx)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = kvh * GROUP + offs_g  # [BLOCK_G] query heads of this KV head
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] token positions
        n_mask = pos < hi
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + pos // BS, mask=n_mask, other=0).to(tl.int64)
        off = pos % BS
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + kvh * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s, v = tile_scores(q, k, v, qk_scale, UPCAST, IEEE)  # s [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, IEEE)
    o_rows = b.to(tl.int64) * stride_ob + heads * stride_oh  # [BLOCK_G]
    if not SPLIT:
        # An empty context (padding rows of a static batch) gives 0, not 0/0.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])
    else:
        tl.store(out_ptr + o_rows[:, None] + split * stride_os + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        ml = (b * (GROUP * tl.num_programs(1)) + heads) * tl.num_programs(2) + split
        tl.store(m_ptr + ml, m_i, mask=g_mask)
        tl.store(l_ptr + ml, l_i, mask=g_mask)


def check_q_and_cache(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The attention launchers' shared check: q [T, H, D] and k/v caches [blocks, BS, KVH, D] alike, H a
    multiple of KVH, one dtype of fp32/bf16/fp16, one device, head_dim contiguous."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: q must be [T, H, D], k/v cache [blocks, BS, KVH, D] alike; "
                         f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    H, D, KVH, Dk = q.shape[1], q.shape[2], k_cache.shape[2], k_cache.shape[3]
    if Dk != D or H % KVH:
        raise ValueError(f"{op}: head_dim {D} vs cache {Dk}, or {H} query heads not a multiple of {KVH} KV heads")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.float32, torch.bfloat16,
                                                                          torch.float16):
        raise ValueError(f"{op}: q and the cache must share fp32/bf16/fp16, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{op}: head_dim of q and the caches must be contiguous")


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int = 1, max_len_bound: Optional[int] = None,
                           block_n: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[b, h] = softmax(scale * q[b, h] · K[b, :L_b, h // G]ᵀ) @ V[b, :L_b, h // G], L_b = context_lens[b].

    q [B, H, D]; k_cache, v_cache [num_blocks, BS, KVH, D] (H = G * KVH); block_tables [B, max_blocks]
    int32/int64 (entries past a sequence's blocks are never read); context_lens [B] int32/int64 (0 =
    padding row: its output is 0); num_splits: parts each context is cut into (split-K); max_len_bound:
    an upper bound of context_lens (host int; default max_blocks * BS) that sizes the parts.
    Returns out [B, H, D] in q's dtype.
    """
    check_q_and_cache("paged_attention_decode", q, k_cache, v_cache)
    B, H, D = q.shape
    _, BS, KVH, _ = k_cache.shape
    if (block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,)
            or block_tables.dtype not in (torch.int32, torch.int64)
            or context_lens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"paged_attention_decode: block_tables must be int [{B}, max_blocks] and context_lens "
                         f"int [{B}]; got {block_tables.dtype} {tuple(block_tables.shape)}, "
                         f"{context_lens.dtype} {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.device != q.device:
            raise ValueError(f"paged_attention_decode: {name} is on {t.device}, q on {q.device}")
    if block_tables.stride(1) != 1:
        raise ValueError("paged_attention_decode: block_tables' columns must be contiguous")
    if num_splits < 1:
        raise ValueError(f"paged_attention_decode: num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"paged_attention_decode: out must be like q {tuple(q.shape)} {q.dtype}")
    if B == 0:
        return out
    group = H // KVH
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot's smallest tile
    block_d = max(16, triton.next_power_of_2(D))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged_attention_decode: block_n must be a power of two >= 16, got {block_n}")
    bound = max_len_bound if max_len_bound is not None else block_tables.shape[1] * BS
    part_len = triton.cdiv(triton.cdiv(max(bound, 1), num_splits), block_n) * block_n
    grid = (B, KVH, num_splits)
    pdl = pdl_available(q.device)  # a programmatic dependent of the kernel before it (kernels/gdc.py)
    common = dict(GROUP=group, BLOCK_G=block_g, D=D, BLOCK_D=block_d, BS=BS, BLOCK_N=block_n,
                  SPLIT=num_splits > 1, UPCAST=dot_upcast(q.dtype),
                  IEEE=dot_upcast(q.dtype) or q.dtype == torch.float32,
                  num_warps=4, num_stages=2, **pdl_launch(pdl))
    args = (q, k_cache, v_cache, block_tables, context_lens, scale * LOG2E, part_len,
            q.stride(0), q.stride(1))
    kv = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
          v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    if num_splits == 1:
        _paged_decode_kernel[grid](out, out, out, *args, out.stride(0), out.stride(1), 0, *kv, **common)
        return out
    acc = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    ell = torch.empty_like(m)
    _paged_decode_kernel[grid](acc, m, ell, *args, acc.stride(0), acc.stride(1), acc.stride(2), *kv, **common)
    # Combine the splits: weights 2^(m_s - max_s m_s) (m in the kernel's log2 domain); empty splits have
    # m = -inf and weigh 0.
    m_max = m.amax(dim=2, keepdim=True)  # [B, H, 1]
    w = torch.exp2(m - torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max))  # [B, H, S]
    den = (w * ell).sum(dim=2, keepdim=True)  # [B, H, 1]
    o = (w[..., None] * acc).sum(dim=2) / torch.where(den > 0, den, torch.ones_like(den))
    out.copy_(o)
    return out
