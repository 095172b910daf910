"""Which variants of the layout-dependent Triton kernels this process has compiled: the warm-up and the
bench compare the set before and after a phase, to see what it compiled."""

from __future__ import annotations

from typing import Optional

from kernels import (lora_apply, lora_expand, lora_gemm, lora_shrink, paged_attention, prefill_attention,
                     silu_mul_lora)
from kernels.platform import interpreter_active

# The kernels whose variants depend on a step's layout (tile buckets, bodies, splits).
LAYOUT_KERNELS = (
    lora_shrink._lora_shrink_kernel, lora_expand._lora_expand_kernel, lora_expand._lora_expand_gemv_kernel,
    lora_apply._lora_fused_gemv_kernel, lora_apply._lora_fused_tma_kernel, lora_gemm._lora_gemm_kernel,
    silu_mul_lora._silu_mul_lora_kernel, silu_mul_lora._silu_mul_lora_tile_kernel,
    paged_attention._paged_decode_kernel, prefill_attention._prefill_attention_kernel,
)


def compiled_keys() -> Optional[set[str]]:
    """"kernel name @ device: specialization key" of every variant of `LAYOUT_KERNELS` this process has
    compiled so far; None under the interpreter (nothing is compiled) or on a triton whose JIT keeps its
    cache elsewhere. A phase that compiled something can say which variant a warm-up missed."""
    if interpreter_active():
        return None
    out: set[str] = set()
    for fn in LAYOUT_KERNELS:
        caches = getattr(fn, "device_caches", None)  # triton >= 3.3: device -> (kernel cache, ...)
        if caches is None:
            return None
        for device, entry in caches.items():
            out.update(f"{fn.fn.__name__} @ {device}: {k}" for k in entry[0])
    return out


def compiled_variants() -> Optional[int]:
    """How many variants `compiled_keys` names (None likewise), without building the keys: cheap
    enough to check around every eager step."""
    if interpreter_active():
        return None
    n = 0
    for fn in LAYOUT_KERNELS:
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        n += sum(len(entry[0]) for entry in caches.values())
    return n


class CompileWatch:
    """Which variants a serving step compiled that the start-up warm-up did not: each costs a request
    seconds of TTFT, so the runner logs them with the step's layout (the warm-up plan can then cover it)."""

    def __init__(self) -> None:
        self._keys = compiled_keys()

    def new_since_last(self) -> list[str]:
        if self._keys is None or compiled_variants() == len(self._keys):
            return []
        keys = compiled_keys() or set()
        new = sorted(keys - self._keys)
        self._keys = keys
        return new
