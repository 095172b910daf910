"""LoRALinear's two kernel paths against the torch twin: prefill-shaped steps through kernels/lora_linear.py
(delta written, base GEMM accumulated into it), biased linears and decode steps through lora_apply after
the base linear. Runs the Triton kernels (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from appliance.lora.backend import policy
from appliance.lora.batch import LoRABatchInfo
from appliance.lora.layers import LoRAContext, LoRALinear
from kernels import reference as ref

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def wrapped(bias: bool, backend: str) -> tuple[LoRALinear, LoRAContext]:
    g = torch.Generator().manual_seed(0)
    base = nn.Linear(32, 40, bias=bias).to(DEV)
    ctx = LoRAContext(backend=backend)
    lin = LoRALinear(base, ("q_proj", "k_proj"), [24, 16], num_slots=3, max_rank=8, ctx=ctx)
    lin.A.copy_(torch.randn(lin.A.shape, generator=g) * 0.3)
    lin.B.copy_(torch.randn(lin.B.shape, generator=g) * 0.3)
    lin.A[1, :, 4:] = 0  # slot 1 at rank 4, slot 2 empty
    lin.B[1, :, 4:] = 0
    lin.A[2].zero_()
    lin.B[2].zero_()
    return lin, ctx


def test_prefill_and_decode_steps_match_the_torch_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """aside: lora.decode_side_stream's path for the decode layout (the shrink beside the base GEMM, the
    expand after it; on CPU without the side stream), through both of its branches: steps lora_apply
    would fuse (kept in the plain order) and steps it would not (on CPU lora_apply always fuses, so
    the second is forced)."""
    ranks = [8, 4, 0]
    for backend in ("triton", "csgmv"):
        for bias, aside in ((False, False), (True, False), (False, "fused"), (False, "split")):
            lin, ctx = wrapped(bias, backend)
            ctx.decode_aside = bool(aside)
            monkeypatch.setattr(policy, "_fuse_pays", lambda pairs, device: aside != "split")
            for seg_lens, seg_slots in (([5, 3, 7, 2], [0, -1, 1, 2]), ([1, 1, 1, 1], [1, 0, -1, 0])):
                x = torch.randn(sum(seg_lens), 32, device=DEV)
                ctx.info = LoRABatchInfo.build(seg_lens, seg_slots, ranks, DEV, backend=backend, max_chunk_size=4)
                token_slots = torch.tensor([s for n, s in zip(seg_lens, seg_slots) for _ in range(n)], device=DEV)
                want = ref.lora_expand(lin.base(x), ref.lora_shrink(x, lin.A, token_slots), lin.B, token_slots,
                                       lin.out_offsets)
                with torch.no_grad():
                    got = lin(x)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"{backend} bias={bias} aside={aside} {seg_lens}: {m}")
                base = token_slots < 0
                torch.testing.assert_close(got[base], lin.base(x)[base].detach(), atol=1e-5, rtol=1e-5)


def test_deferred_gate_up_delta_through_silu_mul_lora(monkeypatch: pytest.MonkeyPatch) -> None:
    """forward_deferred (gate_up_proj under the fused kernels): where the step allows, the base output and
    the shrink's h come back and kernels/silu_mul_lora.py adds the delta inside the activation; the
    result equals silu_mul of forward(x) (for prefill-shaped steps, whose forward(x) is lora_linear's
    order, within rounding). Otherwise (a pinned lora.prefill_gemm, steps lora_apply fuses into one
    launch; on CPU it always would, so that is forced off here) forward(x) comes back whole."""
    from kernels.silu_mul import silu_mul
    from kernels.silu_mul_lora import silu_mul_lora

    ranks = [8, 4, 0]
    for backend in ("triton", "csgmv"):
        for aside in (False, True):
            g = torch.Generator().manual_seed(1)
            base = nn.Linear(32, 48, bias=False).to(DEV)
            ctx = LoRAContext(backend=backend, decode_aside=aside)
            lin = LoRALinear(base, ("gate_proj", "up_proj"), [24, 24], num_slots=3, max_rank=8, ctx=ctx)
            lin.A.copy_(torch.randn(lin.A.shape, generator=g) * 0.3)
            lin.B.copy_(torch.randn(lin.B.shape, generator=g) * 0.3)
            lin.A[1, :, 4:] = 0
            lin.B[1, :, 4:] = 0
            monkeypatch.setattr(policy, "_fuse_pays", lambda pairs, device: False)
            x = torch.randn(5, 32, device=DEV)
            ctx.info = LoRABatchInfo.build([1] * 5, [1, 0, -1, 2, 0], ranks, DEV, backend=backend, max_chunk_size=1)
            with torch.no_grad():
                gate_up, later = lin.forward_deferred(x)
                assert later is not None, backend
                got = silu_mul_lora(gate_up, *later)
                want = silu_mul(lin(x))
            torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m: f"{backend} aside={aside}: {m}")
            # multi-token segments (prefill-shaped, a base row among them): deferred too, under
            # lora.prefill_gemm auto; a pinned prefill_gemm keeps lora_linear (nothing deferred)
            ctx.info = LoRABatchInfo.build([3, 1, 1], [0, -1, 1], ranks, DEV, backend=backend, max_chunk_size=4)
            with torch.no_grad():
                gate_up, later = lin.forward_deferred(x)
                assert later is not None and later[2].max_len > 1, backend
                got = silu_mul_lora(gate_up, *later)
                ctx.prefill_gemm = "cublas"
                y, none = lin.forward_deferred(x)
                assert none is None
                torch.testing.assert_close(y, lin(x), atol=0, rtol=0)
                ctx.prefill_gemm = None
            torch.testing.assert_close(got, silu_mul(y), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{backend} aside={aside} prefill: {m}")
            monkeypatch.setattr(policy, "_fuse_pays", lambda pairs, device: True)  # one launch: nothing deferred
            ctx.info = LoRABatchInfo.build([1] * 5, [1, 0, -1, 2, 0], ranks, DEV, backend=backend, max_chunk_size=1)
            with torch.no_grad():
                assert lin.forward_deferred(x)[1] is None


def test_load_slot_refuses_weights_that_do_not_fit_before_copying() -> None:
    """A slot fill checks every shape first and raises AdapterError (the manager frees the slot and fails
    only that adapter's requests); a RuntimeError from copy_ would have ended the engine's step."""
    from appliance.lora.adapter import AdapterError
    from appliance.lora.layers import load_adapter_into_slot

    lin, ctx = wrapped(False, "torch")
    ctx.wrappers["layers.0.self_attn.qkv_proj"] = lin
    before_a, before_b = lin.A[1].clone(), lin.B[1].clone()
    good = (torch.ones(4, 32), torch.ones(24, 4))
    for bad in ((torch.ones(4, 16), torch.ones(16, 4)),  # in-features of another model
                (torch.ones(9, 32), torch.ones(16, 9)),  # rank above the slots' 8
                (torch.ones(4, 32), torch.ones(16, 3))):  # B's rank differs from A's
        with pytest.raises(AdapterError, match=r"layers\.0\.k_proj: .* do not fit the slot"):
            load_adapter_into_slot(ctx, 1, {"layers.0.q_proj": good, "layers.0.k_proj": bad})
        assert torch.equal(lin.A[1], before_a) and torch.equal(lin.B[1], before_b)  # nothing copied
