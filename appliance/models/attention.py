"""Attention over the paged KV cache, in plain torch (works on CPU and GPU).

The step's tokens are flattened: first the prefill chunks of some sequences, then one decode token for
each decoding sequence. `AttentionMetadata` (built once per step by the model runner) says where each
token's K/V goes in the cache and which cache blocks each sequence reads. `paged_attention` is the one
function a Triton decode kernel replaces on GPU later.

Cache layout per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    q_start: int  # index of this sequence's first new token in the flattened step
    q_len: int  # new tokens of this sequence in this step
    context_len: int  # tokens already in the cache before this step
    block_table: torch.Tensor  # [num_blocks_of_seq] long, on device


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each token
    prefills: list[PrefillSeq]  # in step order; their tokens are [0, num_prefill_tokens)
    num_prefill_tokens: int
    # Decode tokens are [num_prefill_tokens, T), one per sequence.
    decode_block_tables: torch.Tensor  # [D, max_blocks] long (padded with 0)
    decode_context_lens: torch.Tensor  # [D] long: cache length incl. this step's token
    decode_max_len: int  # max of decode_context_lens (host int; sizes the gather)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_context_lens.shape[0])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V: k, v [T, kvh, d] into the cache slots [T]."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d)[slot_mapping] = k
    v_cache.view(-1, kvh, d)[slot_mapping] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the step's queries over each sequence's cached keys and values.

    q: [T, h, d]; k, v: [T, kvh, d] (already written to the cache); returns [T, h, d].
    """
    out = torch.empty_like(q)
    for p in meta.prefills:
        sl = slice(p.q_start, p.q_start + p.q_len)
        if p.context_len == 0:
            # Whole prompt (or first chunk) in this step: attend to the fresh K/V, plain causal.
            out[sl] = _sdpa(q[sl], k[sl], v[sl], None, causal=True, scale=scale)
        else:
            total = p.context_len + p.q_len
            kc, vc = _gather(k_cache, v_cache, p.block_table[None], total)
            qpos = p.context_len + torch.arange(p.q_len, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]  # [q_len, total]
            out[sl] = _sdpa(q[sl], kc[0], vc[0], mask, causal=False, scale=scale)
    if meta.num_decodes:
        qd = q[meta.num_prefill_tokens:]  # [D, h, d]
        kc, vc = _gather(k_cache, v_cache, meta.decode_block_tables, meta.decode_max_len)
        valid = torch.arange(meta.decode_max_len, device=q.device)[None, :] < meta.decode_context_lens[:, None]
        # [D, h, 1, d] x [D, kvh, L, d]
        o = F.scaled_dot_product_attention(
            qd.unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
        out[meta.num_prefill_tokens:] = o.squeeze(2)
    return out


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the first `length` positions of each sequence: [B, length, kvh, d]."""
    bs = k_cache.shape[1]
    nblk = (length + bs - 1) // bs
    bt = block_tables[:, :nblk]
    b = bt.shape[0]
    kc = k_cache[bt].reshape(b, nblk * bs, *k_cache.shape[2:])[:, :length]
    vc = v_cache[bt].reshape(b, nblk * bs, *v_cache.shape[2:])[:, :length]
    return kc, vc


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool, scale: float) -> torch.Tensor:
    """q [n, h, d], k/v [m, kvh, d] -> [n, h, d] for one sequence."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
