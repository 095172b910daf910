"""The LoRA backend: how a wrapped projection adds its adapters' deltas, chosen once at start.

base.py is the interface; torch_ops.py runs plain torch ops on any device; triton_ops.py runs the Triton
kernels of kernels/ (`triton` and `csgmv` differ only in their step metadata, LoRABatchInfo); policy.py
decides which kernel path pays for a step's shape.
"""

from __future__ import annotations

from appliance.lora.backend.base import LoRABackend

BACKENDS = ("torch", "triton", "csgmv")


def make_backend(name: str) -> LoRABackend:
    """The backend for a resolved `lora.backend` (never auto)."""
    if name == "torch":
        from appliance.lora.backend.torch_ops import TorchBackend

        return TorchBackend()
    if name in ("triton", "csgmv"):
        # Imported only here: the torch backend never needs triton (no wheel on some platforms).
        from appliance.lora.backend.triton_ops import TritonBackend

        return TritonBackend()
    raise ValueError(f"lora backend must be one of {', '.join(BACKENDS)}, got {name!r}")
