"""Grid dependency control (programmatic dependent launch, sm90+): the calls and launch keywords kernels share.

    gdc_wait()               block until the grids this one depends on are complete and their writes visible
    gdc_launch_dependents()  let the next grid (launched with launch_pdl=True) start before this one ends
    pdl_launch(on)           the launch keywords (PDL flag, launch_pdl) of a kernel that may be one

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream still runs;
it must call gdc_wait() before it touches anything that kernel (or an earlier one) writes, and in every
program before it may return (a grid whose programs all returned first would count as complete and let
its own dependents run ahead of the kernels it never waited for). kernels.platform.pdl_available says
whether a launch may ask for it. On a triton without the intrinsics these are no-op stand-ins: every
call sits under a constexpr flag that is then off, so they are never compiled in.
"""

from __future__ import annotations

import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


def pdl_launch(on: bool) -> dict:
    """Launch keywords of a kernel with a `PDL: tl.constexpr` flag: PDL=on, and launch_pdl=True only when
    on (so a triton without that launch option never sees it; `on` comes from pdl_available)."""
    return {"PDL": on, **({"launch_pdl": True} if on else {})}


__all__ = ["gdc_launch_dependents", "gdc_wait", "pdl_launch"]
