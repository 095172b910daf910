"""Host staging for side-stream slot copies: one slot's image, and a fixed pool of page-locked buffers.

The CPU tier holds pageable memory (what the cold read produces). A slot copy packs the adapter's
weights into a staging buffer laid out exactly as one slot of every wrapper's A [n, R, in] and
B [out, R] (zero where the adapter has no weights), then copies each region to the device in one
large copy: 2 per wrapped module, not a zero_ and a copy per projection. The pool's buffers are
allocated once at start-up (page-locked on CUDA) and reused: page-locking memory while serving takes
the driver lock that the engine thread's launches need (docs/performance.md, cold adapter loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from appliance.lora.layers import LoRAContext

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Region:
    key: str  # "layers.{i}.{module}": the wrapper's key in LoRAContext.wrappers
    prefix: str  # "layers.{i}": what the adapter's module names start with
    a_off: int  # A image [n, R, in] at buf[a_off : a_off + n*R*in]
    b_off: int  # B image [out, R] right after it


class SlotImage:
    """One slot of every wrapper of `ctx`, as one flat host buffer of `numel` elements."""

    def __init__(self, ctx: LoRAContext) -> None:
        self.ctx = ctx
        self.regions: list[_Region] = []
        off = 0
        dtypes = set()
        for key, w in ctx.wrappers.items():
            a_n, b_n = w.A[0].numel(), w.B[0].numel()
            self.regions.append(_Region(key, key.rsplit(".", 2)[0], off, off + a_n))
            off += a_n + b_n
            dtypes.add(w.A.dtype)
        self.numel = off
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32  # (one dtype: the model's)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def pack(self, buf: torch.Tensor, weights: Weights) -> None:
        """Write `weights` (checked by LoRALinear.check_slot) into `buf` as the slot's image; host
        memcpys only (torch releases the GIL inside each)."""
        for reg in self.regions:
            w = self.ctx.wrappers[reg.key]
            a_img, b_img = self._views(buf, reg)
            got = [weights.get(f"{reg.prefix}.{proj}") for proj in w.slice_names]
            if any(ab is None or ab[0].shape[0] != a_img.shape[1] for ab in got):
                a_img.zero_()  # rows past the adapter's rank and projections it lacks contribute 0
                b_img.zero_()
            for i, ab in enumerate(got):
                if ab is None:
                    continue
                a, b = ab
                r = a.shape[0]
                a_img[i, :r].copy_(a)
                b_img[w.out_offsets[i]:w.out_offsets[i + 1], :r].copy_(b)

    def unpack(self, slot: int, buf: torch.Tensor) -> None:
        """Copy the image in `buf` into `slot` of every wrapper, on the current stream (non-blocking
        from page-locked `buf`)."""
        for reg in self.regions:
            w = self.ctx.wrappers[reg.key]
            a_img, b_img = self._views(buf, reg)
            w.A[slot].copy_(a_img, non_blocking=True)
            w.B[slot].copy_(b_img, non_blocking=True)

    def _views(self, buf: torch.Tensor, reg: _Region) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.ctx.wrappers[reg.key]
        a_shape, b_shape = w.A.shape[1:], w.B.shape[1:]
        a = buf[reg.a_off:reg.b_off].view(a_shape)
        return a, buf[reg.b_off:reg.b_off + w.B[0].numel()].view(b_shape)


class StagingPool:
    """`count` host buffers of `numel` elements, allocated here, once; `take` / `give` reuse them.
    Not thread-safe: one thread (the copier's) owns it."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pin: bool,
                 alloc: Optional[Callable[[], torch.Tensor]] = None) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        make = alloc if alloc is not None else (lambda: torch.empty(numel, dtype=dtype, pin_memory=pin))
        self._all = [make() for _ in range(count)]
        self._free = list(self._all)

    @property
    def count(self) -> int:
        return len(self._all)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> Optional[torch.Tensor]:
        """A free buffer, or None when every one is still being copied from."""
        return self._free.pop() if self._free else None

    def give(self, buf: torch.Tensor) -> None:
        if not any(buf is b for b in self._all) or any(buf is b for b in self._free):
            raise ValueError("give: not a buffer of this pool, or given back twice")
        self._free.append(buf)
