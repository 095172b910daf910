"""appliance/lora/backend/policy.py: which kernel path pays for a step, and the triton backend's automatic
prefill GEMM falling back to the cuBLAS order for a shape whose lora_gemm launch ran out of resources."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from appliance.lora.backend import policy
from appliance.lora.batch import LoRABatchInfo
from appliance.lora.layers import LoRAContext, LoRALinear
from kernels.segments import csgmv_segments, sgmv_segments
from tests.kernels.test_lora_gemm import DEV, case, interpreter_fp32


def test_lora_linear_pays_only_for_prefill_shapes() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not policy.lora_linear_pays(4, sgmv_segments([1, 1, 1, 1], [0, 1, -1, 0], cpu), cpu)  # decode
    assert policy.lora_linear_pays(6, sgmv_segments([5, 1], [0, -1], cpu), cpu)
    long_ = sgmv_segments([2048], [0], cpu)
    assert policy.lora_linear_pays(2048, long_, cuda) and policy.lora_linear_pays(64, sgmv_segments([64], [0], cpu), cuda)
    assert not policy.lora_linear_pays(32, sgmv_segments([32], [0], cpu), cuda)
    for strategy in ("triton", "csgmv"):
        lens, slots = [5, 3, 7, 2], [0, -1, 1, 2]
        segs = sgmv_segments(lens, slots, cpu) if strategy == "triton" else csgmv_segments(lens, slots, 8, cpu)
        assert policy.lora_linear_pays(sum(lens), segs, cpu)


def test_auto_prefill_gemm_falls_back_to_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    # The automatic choice takes the cuBLAS order on CPU; where it picks the Triton GEMM and that runs out
    # of shared memory, it falls back for that shape from then on, and the step's result is the cuBLAS order's.
    import triton

    import kernels.lora_linear as ll

    interpreter_fp32()
    lens, slots, ranks = [20, 9, 3, 30, 15], [0, 2, -1, 1, 0], [16, 5, 1, 8]
    x, W, A, B, offs, ts, r = case(torch.float32, lens, slots, ranks, 40, [32, 16, 16], 16, seed=4)
    base = nn.Linear(40, 64, bias=False).to(DEV)
    with torch.no_grad():
        base.weight.copy_(W)
    ctx = LoRAContext(backend="triton")
    lin = LoRALinear(base, ("q_proj", "k_proj", "v_proj"), [32, 16, 16], num_slots=len(ranks), max_rank=16, ctx=ctx)
    lin.A.copy_(A)
    lin.B.copy_(B)
    ctx.info = LoRABatchInfo.build(lens, slots, ranks, DEV, backend="triton", max_chunk_size=8)
    segs = ctx.info.segments
    xd = x.to(DEV)
    assert not policy.triton_gemm_pays(xd, base.weight, offs, segs)  # CPU: never automatic
    cub = ll.lora_linear(xd, base.weight, lin.A, lin.B, segs, ctx.info.slot_ranks, offs, gemm="cublas")

    def out_of_smem(*a, **k):
        raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(ll, "lora_gemm", out_of_smem)
    monkeypatch.setattr(policy, "triton_gemm_pays", lambda *a: True)
    monkeypatch.setattr(policy, "_REFUSED", set())
    ctx.prefill_gemm = "triton"
    with torch.no_grad(), pytest.raises(triton.runtime.errors.OutOfResources):
        lin(xd)  # asked for by name: the error stands
    ctx.prefill_gemm = None
    with torch.no_grad():
        got = lin(xd)
    torch.testing.assert_close(got, cub, atol=0, rtol=0)
    assert len(policy._REFUSED) == 1
