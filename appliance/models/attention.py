"""Attention over the paged KV cache.

The step's tokens are flattened: first the prefill chunks of some sequences, then one decode token for
each decoding sequence. `AttentionMetadata` (built once per step by the model runner) says where each
token's K/V goes in the cache and which cache blocks each sequence reads.

Decode tokens go through one batched call: the Triton kernel (kernels/paged_attention.py, backend
`triton`: reads each K/V tile once for all query heads of its KV head, lengths read on the device) or
its pure-torch twin (backend `torch`: gathers the KV up to the longest context). Prefill chunks use
SDPA per sequence; a chunk that continues a cached context gets a lower-right causal bias instead of
a materialised [q_len, total] mask.

Cache layout per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels import reference as ref


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
    decode_max_len: int  # max of decode_context_lens (host int; sizes the torch twin's gather only)
    # engine.attention_backend resolved: "triton" = the decode kernel, "torch" = its twin.
    attention_backend: str = "torch"
    # Split-K parts of the Triton decode kernel and the length bound that sizes them (host ints fixed
    # by the batch size and max_model_len, never by this step's lengths; see ModelRunner.decode_splits).
    decode_splits: int = 1
    decode_len_bound: int = 0

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
            # A chunk continuing a cached context: query i sits at position context_len + i, so the
            # causal mask is aligned to the lower right of [q_len, total]; SDPA builds it, not us.
            total = p.context_len + p.q_len
            kc, vc = ref.gather_kv(k_cache, v_cache, p.block_table[None], total)
            out[sl] = _sdpa(q[sl], kc[0], vc[0], causal_lower_right(p.q_len, total), causal=False, scale=scale)
    if meta.num_decodes:
        qd = q[meta.num_prefill_tokens:]  # [D, h, d]
        if meta.attention_backend == "triton":
            from kernels.paged_attention import paged_attention_decode  # needs triton: only when chosen

            out[meta.num_prefill_tokens:] = paged_attention_decode(
                qd, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                num_splits=meta.decode_splits, max_len_bound=meta.decode_len_bound or None)
        else:
            out[meta.num_prefill_tokens:] = ref.paged_attention_decode(
                qd, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                max_len=meta.decode_max_len)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object,
          causal: bool, scale: float) -> torch.Tensor:
    """q [n, h, d], k/v [m, kvh, d] -> [n, h, d] for one sequence."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
