"""Pure-torch twins of the Triton kernels: the oracles of the kernels' tests (prefill attention's among
them), the `torch` backends of the multi-LoRA ops and of decode attention, and the model's own
elementwise path when the fused kernels are off (engine.fused_kernels, appliance/models/fused_ops.py).

Multi-LoRA ops:

Shapes (S = GPU slots, n = slices of a fused projection, R = max_lora_rank, T = tokens in the step):
    x [T, in], A [S, n, R, in], B [S, out, R], token_slots [T] (-1 = base token, no adapter)
Slice i of the fused output occupies columns out_offsets[i]:out_offsets[i+1] of y and rows of B.
B already carries each module's scale (alpha/r or alpha/sqrt(r)), folded in when the adapter loads.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def lora_shrink(x: torch.Tensor, A: torch.Tensor, token_slots: torch.Tensor,
                slot_ranks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h[t, i, :r] = x[t] @ A[slot[t], i, :r]ᵀ  (0 for base tokens and beyond r = slot_ranks[slot[t]]).

    x [T, in], A [S, n, R, in], token_slots [T], slot_ranks [S] (None = every slot at R)
    -> h [T, n, R] in x's dtype (fp32 accumulation).
    """
    T, n, R = x.shape[0], A.shape[1], A.shape[2]
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 accumulation at least (fp64 stays fp64)
    h = torch.zeros(T, n, R, dtype=acc, device=x.device)
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        idx = (token_slots == slot).nonzero().squeeze(1)
        r = A.shape[2] if slot_ranks is None else int(slot_ranks[slot])
        h[idx, :, :r] = torch.einsum("ti,nri->tnr", x[idx].to(acc), A[slot, :, :r].to(acc))
    return h.to(x.dtype)


def lora_expand(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, token_slots: torch.Tensor,
                out_offsets: Sequence[int], slot_ranks: Optional[torch.Tensor] = None,
                scalings: Optional[torch.Tensor] = None, write: bool = False) -> torch.Tensor:
    """y[t, o_i:o_{i+1}] += scale[slot[t]] * h[t, i, :r] @ B[slot[t], o_i:o_{i+1}, :r]ᵀ for every slice i,
    in place; returns y. write=True: y is zeroed first (base tokens' rows end as 0, adapter rows as
    the delta rounded to y's dtype), lora_expand's write mode.

    y [T, out], h [T, n, R], B [S, out, R], token_slots [T], out_offsets [n + 1],
    slot_ranks [S] (r above; None = R), scalings [S] (None = 1: the engine folds scales into B).
    """
    if write:
        y.zero_()
    acc = torch.promote_types(y.dtype, torch.float32)
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        idx = (token_slots == slot).nonzero().squeeze(1)
        r = B.shape[2] if slot_ranks is None else int(slot_ranks[slot])
        scale = 1.0 if scalings is None else float(scalings[slot])
        for i in range(len(out_offsets) - 1):
            lo, hi = out_offsets[i], out_offsets[i + 1]
            delta = scale * (h[idx, i, :r].to(acc) @ B[slot, lo:hi, :r].to(acc).T)
            y[idx, lo:hi] = (y[idx, lo:hi].to(acc) + delta).to(y.dtype)
    return y


def lora_linear(x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                token_slots: torch.Tensor, out_offsets: Sequence[int], slot_ranks: Optional[torch.Tensor] = None,
                scalings: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ weightᵀ + the delta, kernels/lora_linear.py's order: the delta rounded to x's dtype
    first, then the base product added to it in fp32 and rounded once.

    x [T, in], weight [out, in], A, B, token_slots, out_offsets, slot_ranks, scalings as above.
    """
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    lora_expand(y, lora_shrink(x, A, token_slots, slot_ranks), B, token_slots, out_offsets, slot_ranks,
                scalings, write=True)
    acc = torch.promote_types(x.dtype, torch.float32)
    return (y.to(acc) + x.to(acc) @ weight.to(acc).T).to(x.dtype)


def lora_apply_gathered(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                        token_slots: torch.Tensor, out_offsets: Sequence[int]) -> torch.Tensor:
    """The same math with each token's A and B gathered: a fixed handful of ops however many adapters
    the step holds, at the price of copying [T, n, R, in] + [T, out, R] weights. The `torch` backend
    uses it for small steps (decode), where the per-adapter loop's op count dominates.

    Base tokens gather slot 0's weights (any slot would do) and their results are *selected* away, not
    multiplied by 0: slot 0 may hold anything, NaN included, and 0 * NaN = NaN would leak into their rows.
    """
    valid = (token_slots >= 0)[:, None]  # [T, 1]
    s = token_slots.clamp(min=0)
    zero = torch.zeros((), dtype=y.dtype, device=y.device)
    h = torch.einsum("ti,tnri->tnr", x, A[s])  # [T, n, R]; base rows: garbage, never used
    Bs = B[s]  # [T, out, R]
    for i in range(len(out_offsets) - 1):
        lo, hi = out_offsets[i], out_offsets[i + 1]
        y[:, lo:hi] += torch.where(valid, torch.einsum("tr,tor->to", h[:, i], Bs[:, lo:hi]), zero)
    return y


def lora_apply_grouped(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       groups: Sequence[tuple[int, torch.Tensor]], out_offsets: Sequence[int]) -> torch.Tensor:
    """The `torch` backend: shrink then expand, one adapter group at a time (same math as above).

    groups: (slot, token indices [k]) for each slot present in the step, built once per step by
    LoRABatchInfo so no per-layer host sync is needed.
    """
    for slot, idx in groups:
        xs = x.index_select(0, idx)
        h = torch.einsum("ti,nri->tnr", xs, A[slot])  # [k, n, R]
        parts = [h[:, i] @ B[slot, out_offsets[i]:out_offsets[i + 1]].T for i in range(len(out_offsets) - 1)]
        y.index_add_(0, idx, torch.cat(parts, dim=1))
    return y


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the first `length` positions of each sequence: [B, length, kvh, d].

    k_cache, v_cache [num_blocks, BS, kvh, d]; block_tables [B, >= ceil(length / BS)] int.
    """
    bs = k_cache.shape[1]
    nblk = (length + bs - 1) // bs
    bt = block_tables[:, :nblk].long()
    b = bt.shape[0]
    kc = k_cache[bt].reshape(b, nblk * bs, *k_cache.shape[2:])[:, :length]
    vc = v_cache[bt].reshape(b, nblk * bs, *v_cache.shape[2:])[:, :length]
    return kc, vc


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_len: Optional[int] = None) -> torch.Tensor:
    """out[b, h] = softmax(scale * q[b, h] · K[b, :L_b, h // G]ᵀ) @ V[b, :L_b, h // G], L_b = context_lens[b].

    The twin of kernels/paged_attention.py and the `torch` attention backend's decode path: gathers
    each sequence's K/V up to the longest context, masks, one batched SDPA. q [B, H, D]; caches
    [num_blocks, BS, KVH, D]; block_tables [B, max_blocks]; context_lens [B] (0 = padding row -> 0);
    max_len: max(context_lens) when the caller knows it on the host (else read from the device).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if max_len is None:
        max_len = int(context_lens.max())
    max_len = max(max_len, 1)
    kc, vc = gather_kv(k_cache, v_cache, block_tables, max_len)
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    valid[:, 0] |= context_lens == 0  # a padding row attends to something (its output is zeroed)
    keep = valid[:, :, None, None]  # stale or foreign cache rows past a context must not leak (0 * NaN)
    kc = torch.where(keep, kc, torch.zeros((), dtype=kc.dtype, device=kc.device))
    vc = torch.where(keep, vc, torch.zeros((), dtype=vc.dtype, device=vc.device))
    # [B, h, 1, d] x [B, kvh, L, d]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True).squeeze(2)
    return torch.where((context_lens > 0)[:, None, None], o, torch.zeros_like(o))



def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      chunks: Sequence[tuple[int, int, int, Sequence[int]]], scale: float) -> torch.Tensor:
    """out[t, h] = softmax(scale * q[t, h] · K[c, :P_t + 1, h // G]ᵀ) @ V[c, :P_t + 1, h // G] for the rows
    t of every chunk c, P_t = context_len_c + t - q_start_c. The twin of kernels/prefill_attention.py:
    per chunk, gather its K/V, one SDPA with the lower-right causal mask.

    q [T, H, D]; caches [num_blocks, BS, KVH, D]; chunks: (q_start, q_len, context_len, block table)
    each. Returns [T, H, D]; rows in no chunk are 0.
    """
    out = torch.zeros_like(q)
    for q0, n, ctx, table in chunks:
        total = ctx + n
        bt = torch.as_tensor(list(table), dtype=torch.long, device=q.device)[None]
        kc, vc = gather_kv(k_cache, v_cache, bt, total)  # [1, total, kvh, d]
        mask = torch.arange(total, device=q.device)[None, :] <= ctx + torch.arange(n, device=q.device)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q0 + n].transpose(0, 1)[None], kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask,
            scale=scale, enable_gqa=True)
        out[q0:q0 + n] = o[0].transpose(0, 1)
    return out

# ---------------------------------------------------------------- the model's fused elementwise ops

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (rounded to x's dtype; s = x without a residual);
    out = weight * (s / sqrt(mean(s²) + eps)) -> (out, s). The twin of kernels/rms_norm.py.

    x, residual [T, H]; weight [H]. The rms is taken in fp32 and the normalised value rounded to
    x's dtype before the scale, as HF Llama's LlamaRMSNorm does; the add rounds like the model's
    `x + h` in its own dtype. Returns out [T, H] and s [T, H] (s is x itself without a residual).
    """
    s = x if residual is None else x + residual
    dt = s.dtype
    sf = s.float()
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * sf.to(dt), s


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama): x * [cos, cos] + [-x2, x1] * [sin, sin], in fp32, rounded to x's
    dtype. x [T, heads, d]; cos, sin [T, 1, d/2] fp32 (the tables at each token's position)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c = torch.cat([cos, cos], dim=-1)
    s = torch.cat([sin, sin], dim=-1)
    return (xf * c + torch.cat([-x2, x1], dim=-1) * s).to(x.dtype)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """q, k = rope(q, pos), rope(k, pos) in place in qkv; k_cache[slot] = k, v_cache[slot] = v.
    The twin of kernels/rope_kv.py.

    qkv [T, (H + 2*KVH) * d] = q | k | v of each token (rows may be strided, columns contiguous);
    positions [T] int; cos, sin [max_pos, d/2] fp32; k_cache, v_cache [blocks, BS, KVH, d];
    slot_mapping [T] int: cache slot (block * BS + offset) of each token, -1 = not cached. Returns qkv.
    """
    T = qkv.shape[0]
    d = k_cache.shape[-1]
    q_end, k_end = num_heads * d, (num_heads + num_kv_heads) * d
    c = cos[positions.long()][:, None, :]
    s = sin[positions.long()][:, None, :]
    q = qkv[:, :q_end].view(T, num_heads, d)
    k = qkv[:, q_end:k_end].view(T, num_kv_heads, d)
    v = qkv[:, k_end:].view(T, num_kv_heads, d)
    q.copy_(rope_rotate(q, c, s))
    k.copy_(rope_rotate(k, c, s))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, d)[slots] = k[keep]
    v_cache.view(-1, num_kv_heads, d)[slots] = v[keep]
    return qkv


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """out = silu(gate) * up for gate_up [T, 2I] = gate | up -> out [T, I] in gate_up's dtype (silu
    rounded to the dtype before the product, as `F.silu(gate) * up` does). The twin of
    kernels/silu_mul.py."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul_lora(gate_up: torch.Tensor, h: torch.Tensor, B: torch.Tensor, token_slots: torch.Tensor,
                  slot_ranks: Optional[torch.Tensor] = None, scalings: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = silu_mul(gate_up + the LoRA delta of its gate and up slices) -> [T, I]; gate_up is left as
    it was. h [T, 2, R] (or [P, T, 2, R]: planes, summed); B [S, 2I, R]; token_slots [T] (-1 = base).
    The twin of kernels/silu_mul_lora.py: lora_expand (add mode) then silu_mul."""
    h3 = h.sum(0) if h.dim() == 4 else h
    I = gate_up.shape[1] // 2
    y = lora_expand(gate_up.clone(), h3.to(B.dtype).to(h3.dtype), B, token_slots, [0, I, 2 * I], slot_ranks,
                    scalings)
    return silu_mul(y)
