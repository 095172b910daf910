"""rope_write_kv: rotary embedding of q and k fused with writing k and v into the paged KV cache.

    q, k = rope(q, pos), rope(k, pos)  (in place in qkv);   k_cache[slot] = k,  v_cache[slot] = v

for every token of the step, rotate-half convention (HF Llama), fp32 rounded to the model dtype; one
program a token, one launch instead of the torch path's many. Rotated q and k go back into qkv because
prefill attention reads the step's fresh K/V from there; slot -1 = not cached (never written below the cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdc import gdc_launch_dependents, gdc_wait, pdl_launch
from kernels.platform import pdl_available


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,  # [T, (H + 2*KVH) * D] q | k | v of each token, rotated in place
    pos_ptr,  # [T] int position of each token
    cos_ptr, sin_ptr,  # [max_pos, D/2] fp32 tables
    kc_ptr, vc_ptr,  # [blocks, BS, KVH, D] this layer's caches
    slot_ptr,  # [T] int cache slot of each token (-1 = not cached)
    stride_t, stride_cos, stride_sin,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (PDL): qkv is the GEMM's output
        gdc_launch_dependents()  # the decode attention may launch now; it waits for this grid itself
    HALF = D // 2  # constexpr: D is one
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_t
    dt = qkv_ptr.dtype.element_ty

    # q heads: [BLOCK_H, HALF] first and second halves
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_h < H)[:, None] & d_mask[None, :]
    p1 = row + offs_h[:, None] * D + offs_d[None, :]
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(dt), mask=m)
    tl.store(p1 + HALF, (x2 * c + x1 * s).to(dt), mask=m)

    # k heads: rotate, back into qkv and into the cache slot
    offs_kv = tl.arange(0, BLOCK_KV)
    kv_mask = offs_kv < KVH
    m = kv_mask[:, None] & d_mask[None, :]
    p1 = row + H * D + offs_kv[:, None] * D + offs_d[None, :]
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0).to(tl.float32)
    k1 = (x1 * c - x2 * s).to(dt)
    k2 = (x2 * c + x1 * s).to(dt)
    tl.store(p1, k1, mask=m)
    tl.store(p1 + HALF, k2, mask=m)
    cached = (offs_kv * 0 + slot >= 0)[:, None]  # [BLOCK_KV, 1]: a vector mask (the interpreter needs one)
    blk = tl.maximum(slot, 0) // BS
    off = tl.maximum(slot, 0) % BS
    kc = kc_ptr + blk * stride_kb + off * stride_ks + offs_kv[:, None] * stride_kh + offs_d[None, :]
    tl.store(kc, k1, mask=m & cached)
    tl.store(kc + HALF, k2, mask=m & cached)

    # v heads: copied into the cache slot as they are
    offs_v = tl.arange(0, BLOCK_HALF * 2)
    mv = kv_mask[:, None] & (offs_v < D)[None, :]
    v = tl.load(row + (H + KVH) * D + offs_kv[:, None] * D + offs_v[None, :], mask=mv, other=0.0)
    vc = vc_ptr + blk * stride_vb + off * stride_vs + offs_kv[:, None] * stride_vh + offs_v[None, :]
    tl.store(vc, v, mask=mv & cached)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """q, k = rope(q, pos), rope(k, pos) in place in qkv; k_cache[slot] = k, v_cache[slot] = v.

    qkv [T, (H + 2*KVH) * d] fp32/bf16/fp16 = q | k | v of each token (rows may be strided, the
    columns contiguous); positions [T] int32/int64; cos, sin [max_pos, d/2] fp32 (positions must be
    below max_pos); k_cache, v_cache [blocks, BS, KVH, d] in qkv's dtype, d contiguous;
    slot_mapping [T] int32/int64: cache slot (block * BS + offset), -1 = not cached. Returns qkv.
    """
    if qkv.dim() != 2 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"rope_write_kv: qkv must be [T, (H + 2*KVH) * d] and the caches [blocks, BS, KVH, d] "
                         f"alike, got {tuple(qkv.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    T = qkv.shape[0]
    _, BS, KVH, D = k_cache.shape
    if KVH != num_kv_heads or D % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"rope_write_kv: qkv width {qkv.shape[1]} != ({num_heads} + 2 * {num_kv_heads}) * "
                         f"head_dim {D}, or the cache holds {KVH} KV heads, or head_dim is odd")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D // 2 or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32:
        raise ValueError(f"rope_write_kv: cos and sin must be fp32 [max_pos, {D // 2}], got {cos.dtype} "
                         f"{tuple(cos.shape)}, {sin.dtype} {tuple(sin.shape)}")
    if qkv.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not (
            qkv.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"rope_write_kv: qkv and the caches must share fp32/bf16/fp16, got {qkv.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (T,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rope_write_kv: {name} must be int [{T}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("positions", positions), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != qkv.device:
            raise ValueError(f"rope_write_kv: {name} is on {t.device}, qkv on {qkv.device}")
    if qkv.stride(1) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or cos.stride(1) != 1 \
            or sin.stride(1) != 1:
        raise ValueError("rope_write_kv: the columns of qkv, cos, sin and the head_dim of the caches must be "
                         "contiguous")
    if T == 0:
        return qkv
    pdl = pdl_available(qkv.device)  # a programmatic dependent of the GEMM before it (kernels/gdc.py)
    _rope_write_kv_kernel[(T,)](
        qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=num_heads, KVH=KVH, D=D, BS=BS,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(KVH),
        BLOCK_HALF=triton.next_power_of_2(D // 2), num_warps=4, **pdl_launch(pdl))
    return qkv
