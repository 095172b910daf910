"""online_softmax_step: one K/V tile of flash attention's online softmax, shared by the attention kernels.

    m' = max(m, rowmax(s));  p = 2^(s - m');  l' = l * 2^(m - m') + rowsum(p);  acc' = acc * 2^(m - m') + p @ v

s are a tile's scores already scaled by softmax scale * log2(e) (exp2 is the GPU's native exponential),
-inf where masked; m starts at -inf, l and acc at 0, and out = acc / l after the last tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the launchers scale by softmax scale * LOG2E


@triton.jit
def tile_scores(q, k, v, qk_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """q [M, D] and a loaded K/V tile [N, D] -> (scores [M, N] fp32 in the log2 domain, v for the update)."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:  # fp32 inputs: exact products, not tf32
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    return s, v


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, v, IEEE: tl.constexpr):
    """acc [M, D] fp32, m_i / l_i [M] fp32, s [M, N] fp32 (log2 domain), v [N, D] -> (acc, m_i, l_i).
    A row whose scores are all -inf so far keeps m = -inf and must not be read (0/0)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:  # fp32 inputs: exact products, not tf32
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:  # p rounded to the cache dtype for the tensor-core product, as flash attention does
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i
