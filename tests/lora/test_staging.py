"""lora/staging.py: a slot's packed image copied in (SlotImage.unpack) leaves every wrapper's slot
exactly as the CPU twin's per-projection fill (load_adapter_into_slot) does, over ranks below the
slot rank, projections an adapter lacks and a slot that held another adapter; the pool only reuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from appliance.lora.layers import LoRAContext, LoRALinear, load_adapter_into_slot
from appliance.lora.staging import SlotImage, StagingPool

MAX_RANK = 8


def context(slots: int = 3) -> LoRAContext:
    """Two layers of qkv (3 slices) and down_proj (1 slice), small shapes."""
    ctx = LoRAContext(backend="torch")
    for i in range(2):
        qkv = LoRALinear(nn.Linear(32, 48, bias=False), ("q_proj", "k_proj", "v_proj"), [32, 8, 8], slots, MAX_RANK,
                         ctx)
        down = LoRALinear(nn.Linear(64, 32, bias=False), ("down_proj",), [32], slots, MAX_RANK, ctx)
        ctx.wrappers[f"layers.{i}.self_attn.qkv_proj"] = qkv
        ctx.wrappers[f"layers.{i}.mlp.down_proj"] = down
    return ctx


def adapter(seed: int, rank: int, projs: tuple[str, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (32, 32), "k_proj": (32, 8), "v_proj": (32, 8), "down_proj": (64, 32)}
    return {f"layers.{i}.{p}": (torch.randn(rank, shapes[p][0], generator=g),
                                torch.randn(shapes[p][1], rank, generator=g))
            for i in range(2) for p in projs}


@pytest.mark.parametrize("rank,projs", [(MAX_RANK, ("q_proj", "k_proj", "v_proj", "down_proj")),
                                        (3, ("q_proj", "k_proj", "v_proj", "down_proj")),
                                        (MAX_RANK, ("q_proj", "v_proj")),
                                        (5, ("down_proj",))])
def test_unpacked_image_equals_the_per_projection_fill(rank: int, projs: tuple[str, ...]) -> None:
    want, got = context(), context()
    image = SlotImage(got)
    assert image.numel == sum(w.A[0].numel() + w.B[0].numel() for w in got.wrappers.values())
    buf = torch.full((image.numel,), float("nan"))  # a reused buffer: stale values everywhere
    for seed, (r, p) in enumerate([(MAX_RANK, ("q_proj", "k_proj", "v_proj", "down_proj")), (rank, projs)]):
        weights = adapter(seed, r, p)  # the second adapter replaces the first in slot 1
        load_adapter_into_slot(want, 1, weights)
        image.pack(buf, weights)
        image.unpack(1, buf)
    for key, w in got.wrappers.items():
        assert torch.equal(w.A, want.wrappers[key].A), key
        assert torch.equal(w.B, want.wrappers[key].B), key
        assert not w.A[0].any() and not w.A[2].any()  # other slots untouched


def test_pool_reuses_its_buffers_and_never_allocates_again() -> None:
    made: list[torch.Tensor] = []

    def alloc() -> torch.Tensor:
        made.append(torch.empty(4))
        return made[-1]

    pool = StagingPool(2, 4, torch.float32, pin=False, alloc=alloc)
    assert (pool.count, pool.free, len(made)) == (2, 2, 2)
    a, b = pool.take(), pool.take()
    assert a is not None and b is not None and a is not b and pool.take() is None
    pool.give(a)
    assert pool.take() is a and len(made) == 2
    with pytest.raises(ValueError):
        pool.give(torch.empty(4))  # not one of its buffers
    pool.give(b)
    with pytest.raises(ValueError):
        pool.give(b)  # twice
