"""The model's fused elementwise kernels against their torch twins (kernels/reference.py).

rms_norm.py (residual add + RMSNorm), rope_kv.py (RoPE on q and k + the paged K/V cache write) and
silu_mul.py, each in fp32/bf16/fp16 over sizes that are not powers of two. On CPU they run in
Triton's interpreter (tests/conftest.py). Outputs are poisoned with NaN before the call, so an
element the kernel fails to write shows up; cache slots that must not be written are NaN too and
must stay NaN, as must the v columns of qkv (the rotation leaves them alone).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.rms_norm import rms_norm
from kernels.rope_kv import rope_write_kv
from kernels.silu_mul import silu_mul

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {  # dtype -> (atol, rtol) of the kernel against the same-dtype twin (a rounding step apart)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert not got.isnan().any(), "an output element was not written"
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 576), (3, 1000)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_twin(dtype: torch.dtype, T: int, H: int, with_residual: bool) -> None:
    x = randn(T, H, dtype=dtype, seed=1, scale=3.0)
    res = randn(T, H, dtype=dtype, seed=2) if with_residual else None
    w = randn(H, dtype=dtype, seed=3)
    out = torch.full((T, H), float("nan"), dtype=dtype, device=DEV)
    res_out = torch.full((T, H), float("nan"), dtype=dtype, device=DEV) if with_residual else None
    got, got_s = rms_norm(x, w, 1e-5, res, out=out, residual_out=res_out)
    want, want_s = ref.rms_norm(x, w, 1e-5, res)
    assert got is out
    close(got, want, dtype)
    if with_residual:
        assert got_s is res_out
        # The add is one rounding of the exact fp32 sum in both: equal bit for bit, except that
        # Triton's interpreter truncates fp32 -> bf16 where a GPU rounds to nearest (1 ulp).
        if dtype == torch.bfloat16 and DEV.type == "cpu":
            close(got_s, want_s, dtype)
        else:
            assert torch.equal(got_s, want_s)
    else:
        assert got_s is x


def test_rms_norm_strided_rows_and_in_place_residual() -> None:
    T, H = 4, 96
    big = randn(T, 2 * H, dtype=torch.bfloat16, seed=4)  # bf16: the interpreter truncates, see above
    x = big[:, H:]  # rows strided by 2H
    res = randn(T, H, dtype=torch.bfloat16, seed=5)
    w = randn(H, dtype=torch.bfloat16, seed=6)
    want, want_s = ref.rms_norm(x, w, 1e-6, res)
    got, got_s = rms_norm(x, w, 1e-6, res, residual_out=res)  # the residual updated in place
    assert got_s is res
    close(res, want_s, torch.bfloat16)
    close(got, want, torch.bfloat16)


def test_rms_norm_twin_is_the_old_model_math() -> None:
    # The model's torch path before the fused kernels: x = x + h; weight * norm(x) in fp32, rounded.
    x, h, w = (randn(3, 64, dtype=torch.bfloat16, seed=s) for s in (7, 8, 9))
    s = x + h
    sf = s.float()
    old = w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    out, s2 = ref.rms_norm(h, w, 1e-5, x)
    assert torch.equal(out, old) and torch.equal(s2, s)


def test_rms_norm_refuses_bad_arguments() -> None:
    x = randn(2, 64, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, randn(32, dtype=torch.float32, seed=0), 1e-5)
    with pytest.raises(ValueError, match="share"):
        rms_norm(x, randn(64, dtype=torch.float16, seed=0), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, randn(64, dtype=torch.float32, seed=0), 1e-5, residual=randn(2, 64, dtype=torch.float16, seed=0))
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), randn(2, dtype=torch.float32, seed=0), 1e-5)


# ---------------------------------------------------------------- rope_write_kv

def rope_tables(max_pos: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv).float()
    return f.cos().to(DEV), f.sin().to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,D", [(4, 2, 64), (9, 3, 64), (6, 6, 32), (5, 1, 80)])
def test_rope_write_kv_matches_twin(dtype: torch.dtype, H: int, KVH: int, D: int) -> None:
    T, BS, blocks = 7, 16, 6
    cos, sin = rope_tables(300, D)
    qkv = randn(T, (H + 2 * KVH) * D, dtype=dtype, seed=10)
    positions = torch.tensor([0, 1, 17, 299, 5, 64, 130], device=DEV)
    # Scattered slots across blocks, one token not cached (-1); everything else in the caches is NaN
    # and must stay NaN.
    slots = torch.tensor([3, 16 * 4 + 15, 16 * 2, -1, 16 * 5 + 7, 9, 16 + 1], device=DEV)
    kc = torch.full((blocks, BS, KVH, D), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    got_qkv, got_k, got_v = qkv.clone(), kc.clone(), vc.clone()
    rope_write_kv(got_qkv, positions, cos, sin, got_k, got_v, slots, H, KVH)
    ref.rope_write_kv(qkv, positions, cos, sin, kc, vc, slots, H, KVH)
    atol, rtol = TOL[dtype]
    assert not got_qkv.isnan().any()
    torch.testing.assert_close(got_qkv.float(), qkv.float(), atol=atol, rtol=rtol)
    v0 = (H + KVH) * D
    assert torch.equal(got_qkv[:, v0:], qkv[:, v0:])  # v untouched
    for got_c, want_c in ((got_k, kc), (got_v, vc)):
        assert torch.equal(got_c.isnan(), want_c.isnan())  # exactly the cached slots written
        torch.testing.assert_close(got_c.float().nan_to_num(), want_c.float().nan_to_num(), atol=atol, rtol=rtol)
    assert int((~kc.isnan()).sum()) == 6 * KVH * D


def test_rope_write_kv_twin_is_the_old_model_math() -> None:
    # The torch path: RotaryEmbedding on q/k views, then write_kv's index_put into the caches.
    from appliance.models.attention import write_kv

    H, KVH, D, T = 4, 2, 64, 5
    cos, sin = rope_tables(64, D)
    qkv = randn(T, (H + 2 * KVH) * D, dtype=torch.bfloat16, seed=11)
    pos = torch.tensor([3, 0, 9, 63, 1], device=DEV)
    slots = torch.tensor([0, 5, 17, 30, 31], device=DEV)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    q2 = ref.rope_rotate(q.reshape(T, H, D), c, s)
    k2 = ref.rope_rotate(k.reshape(T, KVH, D), c, s)
    kc = torch.zeros(2, 16, KVH, D, dtype=torch.bfloat16, device=DEV)
    vc = torch.zeros_like(kc)
    write_kv(k2, v.reshape(T, KVH, D), kc, vc, slots)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(kc)
    out = ref.rope_write_kv(qkv.clone(), pos, cos, sin, kc2, vc2, slots, H, KVH)
    assert torch.equal(out[:, :H * D], q2.reshape(T, -1)) and torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_rope_write_kv_strided_rows_and_int32_metadata() -> None:
    H, KVH, D, T = 4, 2, 32, 3
    cos, sin = rope_tables(40, D)
    W = (H + 2 * KVH) * D
    big = randn(T, W + 16, dtype=torch.float32, seed=12)
    pos = torch.tensor([1, 2, 39], dtype=torch.int32, device=DEV)
    slots = torch.tensor([2, 7, 30], dtype=torch.int32, device=DEV)
    kc = torch.zeros(2, 16, KVH, D, device=DEV)
    vc = torch.zeros_like(kc)
    want = big.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    ref.rope_write_kv(want[:, :W], pos, cos, sin, kc2, vc2, slots, H, KVH)
    rope_write_kv(big[:, :W], pos, cos, sin, kc, vc, slots, H, KVH)
    close(big, want, torch.float32)
    close(kc, kc2, torch.float32)
    assert torch.equal(vc, vc2)


def test_rope_write_kv_refuses_bad_arguments() -> None:
    cos, sin = rope_tables(16, 32)
    qkv = randn(2, 8 * 32, dtype=torch.float32, seed=0)
    kc = torch.zeros(1, 16, 2, 32, device=DEV)
    pos = torch.zeros(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="width"):
        rope_write_kv(qkv, pos, cos, sin, kc, kc.clone(), pos, 5, 2)
    with pytest.raises(ValueError, match="fp32"):
        rope_write_kv(qkv, pos, cos.half(), sin.half(), kc, kc.clone(), pos, 4, 2)
    with pytest.raises(ValueError, match="share"):
        rope_write_kv(qkv, pos, cos, sin, kc.half(), kc.half(), pos, 4, 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_write_kv(qkv, pos, cos, sin, kc, kc.clone(), pos.float(), 4, 2)


# ---------------------------------------------------------------- silu_mul

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I,block", [(1, 64, 1024), (6, 1000, 256), (3, 37, 16)])
def test_silu_mul_matches_twin(dtype: torch.dtype, T: int, I: int, block: int) -> None:
    gu = randn(T, 2 * I, dtype=dtype, seed=20, scale=4.0)
    out = torch.full((T, I), float("nan"), dtype=dtype, device=DEV)
    got = silu_mul(gu, out=out, block=block)
    assert got is out
    close(got, ref.silu_mul(gu), dtype)


def test_silu_mul_strided_rows_and_bad_arguments() -> None:
    big = randn(4, 300, dtype=torch.float16, seed=21)
    gu = big[:, :200]
    close(silu_mul(gu), ref.silu_mul(gu), torch.float16)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul(big[:, :7])
    with pytest.raises(ValueError, match="power of two"):
        silu_mul(gu, block=100)
    with pytest.raises(ValueError, match="out"):
        silu_mul(gu, out=torch.empty(4, 99, dtype=torch.float16, device=DEV))
