"""Slot isolation: a row's LoRA result depends only on its own slot's weights.

A NaN adapter pinned in a slot and never requested, or NaN left in an empty (rank-0) slot, must leave
base rows (slot -1) and the rows of every other adapter bit-identical to a run where those slots hold
zeros. Swept over the backends (torch: the gathered decode path and the grouped prefill path; triton
and csgmv in Triton's interpreter on CPU: lora_apply, lora_linear, the decode side-stream order, the
slot-sorted static decode layout, gate_up's deferred expand through silu_mul_lora, lora_gemm), then once through
the engine with the tiny Llama (the attack as it was run: greedy text of a base request batched with
two adapter requests while a NaN adapter sits pinned in slot 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from torch import nn

from appliance.lora.backend import policy
from appliance.lora.batch import LoRABatchInfo
from appliance.lora.layers import LoRAContext, LoRALinear
from kernels.segments import sorted_segments_device

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RANKS = [8, 8, 4, 0]  # slot 0: the NaN adapter (pinned, never requested); 3: empty, NaN garbage left in it
POISONED = (0, 3)
# (seg_lens, seg_slots): decode (one token per sequence: torch's gathered path), prefill-shaped
# (torch's grouped path, lora_linear for the kernels), and a step with base rows only.
LAYOUTS = {
    "decode": ([1] * 6, [-1, 1, 2, -1, 1, 2]),
    "prefill": ([5, 3, 4, 2], [1, -1, 2, -1]),
    "base_only": ([2, 1], [-1, -1]),
}


def wrapper(backend: str, slices: tuple[str, ...], sizes: list[int], poison: bool) -> tuple[LoRALinear, LoRAContext]:
    g = torch.Generator().manual_seed(0)
    ctx = LoRAContext(backend=backend, max_chunk_size=2)
    base = nn.Linear(32, sum(sizes), bias=False).to(DEV)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=g) * 0.2)
    lin = LoRALinear(base, slices, sizes, num_slots=len(RANKS), max_rank=8, ctx=ctx)
    for s, r in enumerate(RANKS):  # clean slots as load_slot leaves them: [:r] filled, the rest zero
        lin.A[s, :, :r] = torch.randn(lin.A[s, :, :r].shape, generator=g) * 0.3
        lin.B[s, :, :r] = torch.randn(lin.B[s, :, :r].shape, generator=g) * 0.3
    for s in POISONED:
        lin.A[s] = float("nan") if poison else 0.0
        lin.B[s] = float("nan") if poison else 0.0
    return lin, ctx


def info_for(backend: str, seg_lens: list[int], seg_slots: list[int], sorted_decode: bool) -> LoRABatchInfo:
    info = LoRABatchInfo.build(seg_lens, seg_slots, RANKS, DEV, backend=backend, max_chunk_size=2)
    if sorted_decode:  # the static decode graph's layout: rows sorted by slot, base rows in chunks of -1
        rows = torch.tensor(seg_slots, dtype=torch.int32, device=DEV)
        info.segments = sorted_segments_device(rows, len(RANKS), 2)
    return info


def run(backend: str, layout: str, mode: str, poison: bool) -> torch.Tensor:
    """One projection's output for the layout, through the path `mode` names."""
    from kernels.silu_mul import silu_mul

    seg_lens, seg_slots = LAYOUTS[layout]
    two = mode == "deferred"
    lin, ctx = wrapper(backend, ("gate_proj", "up_proj") if two else ("q_proj", "k_proj", "v_proj"),
                       [16, 16] if two else [32, 16, 16], poison)
    ctx.decode_aside = mode in ("aside", "sorted")
    ctx.prefill_gemm = "triton" if mode == "gemm" else None  # lora_gemm: the delta in the GEMM's epilogue
    ctx.info = info_for(backend, seg_lens, seg_slots, mode == "sorted")
    x = torch.randn(sum(seg_lens), 32, generator=torch.Generator().manual_seed(1)).to(DEV)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        if mode in ("aside", "deferred"):  # on CPU lora_apply always fuses: force the split order
            mp.setattr(policy, "_fuse_pays", lambda pairs, device: False)
        if two:
            from kernels.silu_mul_lora import silu_mul_lora

            gate_up, later = lin.forward_deferred(x)
            return (silu_mul(gate_up) if later is None else silu_mul_lora(gate_up, *later)).cpu()
        return lin(x).cpu()


CASES = [("torch", "plain")] + [(b, m) for b in ("triton", "csgmv") for m in ("plain", "aside", "deferred", "gemm")] + [
    ("csgmv", "sorted")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend,mode", CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_nan_in_other_slots_leaves_every_other_row_bit_identical(backend: str, mode: str, layout: str) -> None:
    if mode == "sorted" and layout != "decode":
        pytest.skip("the slot-sorted layout is the static decode batch's (one token per row)")
    if mode == "gemm":
        from kernels.lora_gemm import platform_reason

        if layout != "prefill":
            pytest.skip("lora_gemm runs prefill-shaped steps only")
        why = platform_reason(DEV, torch.float32)
        if why is not None:
            pytest.skip(why)
    clean = run(backend, layout, mode, poison=False)
    dirty = run(backend, layout, mode, poison=True)
    assert clean.isfinite().all()
    assert torch.equal(dirty, clean), (
        f"{backend}/{mode}/{layout}: rows {sorted(set(dirty.isnan().any(1).nonzero().flatten().tolist()))} "
        "changed by NaN weights in slots no row uses")


# ------------------------------------------------------------------ the engine, end to end


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_adapter_pinned_in_slot_0_does_not_change_base_greedy_text(backend: str, tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    """The attack: a NaN adapter pinned (slot 0) and never requested, a base request decoded in the same
    steps as two clean adapters' requests (torch: the gathered path, which mapped base rows to slot 0).
    The loader now refuses NaN weights, so the NaN goes into the pinned slot's buffers directly."""
    from appliance.lora.layers import load_adapter_into_slot
    from tests.lora.test_lora_engine import PROMPTS, lora_engine, make_adapter, run_mixed

    root = tmp_path / "adapters"
    kw = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    paths = {n: make_adapter(tiny_model_dir, root / n, seed=i, **kw) for i, n in enumerate(("pinned", "a", "b"))}
    jobs: list[tuple[Optional[str], int]] = [(None, 0), ("a", 1), ("b", 2), (None, 3)]
    new = 4 if backend != "torch" else 8

    def greedy(poison: Callable[[object], None]) -> dict[int, list[int]]:
        engine = lora_engine(tiny_model_dir, root, f"lora.backend={backend}", "lora.max_loras_per_batch=4")
        for n, p in paths.items():
            engine.lora.load(n, str(p), pinned=n == "pinned")
        poison(engine)
        return run_mixed(engine, jobs, new=new)

    def nan_in_pinned_slot(engine) -> None:
        lora = engine.lora
        slot = lora.pool.lookup(lora.current["pinned"])
        assert slot == 0
        nan = {name: (torch.full_like(a, float("nan")), torch.full_like(b, float("nan")))
               for name, (a, b) in lora.host.get(lora.current["pinned"]).items()}
        load_adapter_into_slot(lora.ctx, slot, nan)

    clean = greedy(lambda engine: None)
    dirty = greedy(nan_in_pinned_slot)
    assert len(PROMPTS) == 4 and dirty == clean
