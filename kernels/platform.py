"""Where the Triton kernels can run: a CUDA device, or the CPU under Triton's interpreter.

We ask triton's own knobs (else TRITON_INTERPRET) so the answer matches what a launch will do.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch


def interpreter_active() -> bool:
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device) -> Optional[str]:
    """None when the Triton kernels can run on `device`, else why not (a sentence for the operator)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreter_active():
        return None  # slow, but exact: the CPU tests and CI run the kernels this way
    return (f"the Triton kernels need a CUDA device, and the model runs on {device}; use backend torch "
            "(or set TRITON_INTERPRET=1 before start to run them in Triton's slow CPU interpreter)")


def dot_upcast(dtype: torch.dtype) -> bool:
    """Triton's interpreter (3.9) multiplies bf16 tiles in tl.dot as raw integers; upcasting both
    operands to fp32 first gives the exact bf16 products with fp32 accumulation that a GPU computes."""
    return dtype == torch.bfloat16 and interpreter_active()


@functools.lru_cache(maxsize=None)
def _pdl_on(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched as programmatic dependents of the kernel before them
    (PDL: the next grid starts while the previous one drains, and waits in-kernel, at
    `griddepcontrol.wait`, only where it needs that grid's output). Hopper (sm90) and later, compiled
    (never under the interpreter), on a triton that has the launch option and the GDC intrinsics."""
    if device.type != "cuda" or interpreter_active():
        return False
    return _pdl_on(device.index if device.index is not None else torch.cuda.current_device())
