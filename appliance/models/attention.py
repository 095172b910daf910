"""Attention over the paged KV cache.

The step's tokens are flattened: first the prefill chunks of some sequences, then one decode token for
each decoding sequence. `AttentionMetadata` (built once per step by the model runner) says where each
token's K/V goes in the cache and which cache blocks each sequence reads.

Backend `triton` (engine.attention_backend): decode tokens in one launch of kernels/paged_attention.py
(each K/V tile read once for all query heads of its KV head, lengths read on the device); with
engine.prefill_attention_kernel, all prefill chunks of the step in one launch of
kernels/prefill_attention.py, which reads K/V straight from the paged cache (this step's are written
before attention) through `PrefillTiles` built once per step, else prefills as below. Backend
`torch` (the CPU default and the kernels' oracle): prefill chunks use SDPA per sequence; a lone chunk that continues a cached context gets a lower-right causal bias, two or more
such chunks (prefix-cache hits, chunked prefill) one padded SDPA call per group (`ContextGroup`,
built once per step); decode tokens the decode kernel's twin (gathers the KV up to the longest context).

Cache layout per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels import reference as ref
from kernels.prefill_tiles import PrefillTiles


@dataclass
class PrefillSeq:
    q_start: int  # index of this sequence's first new token in the flattened step
    q_len: int  # new tokens of this sequence in this step
    context_len: int  # tokens already in the cache before this step
    # [num_blocks_of_seq] long, on device; backend torch only (the triton kernel reads PrefillTiles.tables)
    block_table: Optional[torch.Tensor]


# Gathered K/V positions of one group (B x longest context): bounds its transient memory.
CONTEXT_GROUP_POSITIONS = 65536
# Longer chunks stay on their own: their call overhead is amortised, and a group's mask grows with them.
CONTEXT_GROUP_MAX_Q = 256


@dataclass
class ContextGroup:
    """Prefill chunks that continue a cached context, padded to one SDPA call."""

    block_tables: torch.Tensor  # [B, nb] long (padded with 0)
    length: int  # longest context + chunk of the group: the K/V positions gathered
    q_index: torch.Tensor  # [B, Q] long: each query's token in the step (padding -> 0)
    valid: torch.Tensor  # [B, Q] bool: real queries
    out_index: torch.Tensor  # [N] long: q_index[valid], where the outputs go
    valid_index: torch.Tensor  # [N] long: flat positions (b * Q + i) of the real queries
    mask: torch.Tensor  # [B, Q, T] bool: key j visible to query i (padding rows see key 0 only)
    _grouped: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, group: int) -> torch.Tensor:
        """[B, 1, Q * group, T]: the mask with each query row repeated for the query heads of a KV head."""
        if group not in self._grouped:
            self._grouped[group] = self.mask.repeat_interleave(group, dim=1)[:, None]
        return self._grouped[group]


def groupable(q_len: int, context_len: int) -> bool:
    """Whether a prefill chunk goes through a ContextGroup (when the step has two or more such chunks)."""
    return context_len > 0 and q_len <= CONTEXT_GROUP_MAX_Q


def context_groups(prefills: Sequence[tuple[int, int, int, Sequence[int]]], block_size: int,
                   device: torch.device) -> list[ContextGroup]:
    """Groups of the step's short chunks with a cached context, when there are two or more (else [])."""
    ctx = sorted((p for p in prefills if groupable(p[1], p[2])), key=lambda p: p[2] + p[1])
    if len(ctx) < 2:
        return []
    groups, cur = [], []
    for p in ctx:  # sorted by length: each group pads to its own longest
        if cur and (len(cur) + 1) * (p[2] + p[1]) > CONTEXT_GROUP_POSITIONS:
            groups.append(cur)
            cur = []
        cur.append(p)
    groups.append(cur)
    return [_group(g, block_size, device) for g in groups]


def _group(chunks: list, block_size: int, device: torch.device) -> ContextGroup:
    length = max(c + n for _, n, c, _ in chunks)
    q_max = max(n for _, n, _, _ in chunks)
    nb = (length + block_size - 1) // block_size
    tables = torch.tensor([list(t[:nb]) + [0] * (nb - len(t[:nb])) for *_, t in chunks], dtype=torch.long)
    q0 = torch.tensor([q for q, _, _, _ in chunks])[:, None]
    n = torch.tensor([n for _, n, _, _ in chunks])[:, None]
    c = torch.tensor([c for _, _, c, _ in chunks])[:, None, None]
    i = torch.arange(q_max)[None]
    valid = i < n
    q_index = torch.where(valid, q0 + i, 0)
    j = torch.arange(length)[None, None]
    mask = torch.where(valid[:, :, None], j <= c + i[:, :, None], j == 0)
    # Index tensors built here, on the host: a boolean index on the device would sync every layer.
    return ContextGroup(tables.to(device), length, q_index.to(device), valid.to(device),
                        q_index[valid].to(device), valid.flatten().nonzero().squeeze(1).to(device), mask.to(device))


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
    # Backend torch: chunks with a cached context batched per group (context_groups); [] = each on its own.
    context_groups: list[ContextGroup] = field(default_factory=list)
    # engine.prefill_attention_kernel (backend triton): the prefill chunks' tiles (kernels/prefill_tiles.py);
    # None = prefills by SDPA per chunk (context_groups above).
    prefill_tiles: Optional[PrefillTiles] = None

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
    if meta.prefill_tiles is not None:  # engine.prefill_attention_kernel (backend triton)
        _kernel_prefills(q, k_cache, v_cache, meta.prefill_tiles, scale, out)
    else:
        _torch_prefills(q, k, v, k_cache, v_cache, meta, scale, out)
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


def _kernel_prefills(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: PrefillTiles,
                     scale: float, out: torch.Tensor) -> None:
    """Backend triton: every prefill chunk's rows of `out` in one kernel launch (K/V from the paged cache)."""
    if tiles.num_tiles:
        from kernels.prefill_attention import prefill_attention  # needs triton: only when chosen

        prefill_attention(q, k_cache, v_cache, tiles, scale, out=out[:tiles.num_tokens])


def _torch_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Backend torch: SDPA per chunk, chunks with a context batched per group (context_groups)."""
    for g in meta.context_groups:
        _context_group(q, k_cache, v_cache, g, scale, out)
    for p in meta.prefills:
        sl = slice(p.q_start, p.q_start + p.q_len)
        if meta.context_groups and groupable(p.q_len, p.context_len):
            continue  # done above
        if p.context_len == 0:
            # Whole prompt (or first chunk) in this step: attend to the fresh K/V, plain causal.
            out[sl] = _sdpa(q[sl], k[sl], v[sl], None, causal=True, scale=scale)
        else:
            # A chunk continuing a cached context: query i sits at position context_len + i, so the
            # causal mask is aligned to the lower right of [q_len, total]; SDPA builds it, not us.
            total = p.context_len + p.q_len
            kc, vc = ref.gather_kv(k_cache, v_cache, p.block_table[None], total)
            out[sl] = _sdpa(q[sl], kc[0], vc[0], causal_lower_right(p.q_len, total), causal=False, scale=scale)


def _context_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: ContextGroup,
                   scale: float, out: torch.Tensor) -> None:
    """One SDPA call for a group: the query heads of a KV head ride as extra query rows (no GQA
    expansion of the gathered K/V)."""
    kc, vc = ref.gather_kv(k_cache, v_cache, g.block_tables, g.length)  # [B, T, kvh, d]
    b, q_max = g.q_index.shape
    h, d = q.shape[1], q.shape[2]
    kvh = kc.shape[2]
    grp = h // kvh
    qb = q[g.q_index].view(b, q_max, kvh, grp, d).permute(0, 2, 1, 3, 4).reshape(b, kvh, q_max * grp, d)
    o = F.scaled_dot_product_attention(qb, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=g.mask_for(grp),
                                       scale=scale)
    o = o.view(b, kvh, q_max, grp, d).permute(0, 2, 1, 3, 4).reshape(b * q_max, h, d)
    out[g.out_index] = o[g.valid_index]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object,
          causal: bool, scale: float) -> torch.Tensor:
    """q [n, h, d], k/v [m, kvh, d] -> [n, h, d] for one sequence."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
