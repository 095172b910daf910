"""Which kernel path pays for a step's shape (host ints only, no sync); thresholds: docs/performance.md."""

from __future__ import annotations

from typing import Sequence

import torch

from kernels.lora_gemm import unfit_reason
from kernels.segments import LoRASegments

# Prefill-shaped steps from this many tokens on CUDA take lora_linear (delta under the base GEMM).
MIN_TOKENS_CUDA = 64
# Steps whose tokens fall in this range take lora_gemm (the delta in the GEMM's epilogue) on sm90+.
TRITON_GEMM_TOKENS = (4096, 8192)
# ... up to this many tokens for outputs at most NARROW_OUT columns wide (o_proj, down_proj).
TRITON_GEMM_TOKENS_NARROW = 16384
NARROW_OUT = 4096
# One-token steps fuse shrink and expand into one launch when (token, slice) pairs cover the SMs this often.
FUSE_MIN_WAVES = 1.5

_REFUSED: set = set()  # shapes whose lora_gemm launch ran out of resources on their device


def lora_linear_pays(num_tokens: int, segs: LoRASegments, device: torch.device) -> bool:
    """Whether a step runs its wrapped projections through lora_linear: multi-token segments (base rows
    listed) and, on CUDA, enough tokens for the GEMM to be compute bound; on CPU every such step (tests)."""
    if segs.max_len <= 1 or segs.base_rows is None:
        return False
    return device.type != "cuda" or num_tokens >= MIN_TOKENS_CUDA


def triton_gemm_pays(x: torch.Tensor, weight: torch.Tensor, out_offsets: Sequence[int], segs: LoRASegments) -> bool:
    """lora_linear's automatic choice: lora_gemm on a CUDA device for TRITON_GEMM_TOKENS (to
    TRITON_GEMM_TOKENS_NARROW for narrow outputs), where the platform and operands fit it."""
    T = x.shape[0]
    hi = TRITON_GEMM_TOKENS_NARROW if weight.shape[0] <= NARROW_OUT else TRITON_GEMM_TOKENS[1]
    if x.device.type != "cuda" or not TRITON_GEMM_TOKENS[0] <= T <= hi or segs.row_slots is None:
        return False
    return unfit_reason(x, weight, out_offsets) is None


def _shape_key(x: torch.Tensor, weight: torch.Tensor, out_offsets: Sequence[int], A: torch.Tensor) -> tuple:
    return (x.device, x.dtype, tuple(weight.shape), tuple(out_offsets), A.shape[2])


def prefill_gemm(x: torch.Tensor, weight: torch.Tensor, out_offsets: Sequence[int], segs: LoRASegments,
                 A: torch.Tensor) -> str:
    """lora.prefill_gemm auto for one step: "triton" where triton_gemm_pays and the shape was never refused."""
    if _shape_key(x, weight, out_offsets, A) in _REFUSED:
        return "cublas"
    return "triton" if triton_gemm_pays(x, weight, out_offsets, segs) else "cublas"


def refuse(x: torch.Tensor, weight: torch.Tensor, out_offsets: Sequence[int], A: torch.Tensor) -> None:
    """A lora_gemm launch of this shape ran out of resources: auto takes the cuBLAS order for it from now on."""
    _REFUSED.add(_shape_key(x, weight, out_offsets, A))


def fuses(segs: LoRASegments, A: torch.Tensor, device: torch.device) -> bool:
    """Whether lora_apply takes its one-launch kernel: one-token segments whose pairs fill the SMs."""
    return segs.max_len == 1 and _fuse_pays(segs.num_segs * A.shape[1], device)


def _fuse_pays(pairs: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # the interpreter: the fused path is the one the CPU tests exercise
    return pairs >= FUSE_MIN_WAVES * torch.cuda.get_device_properties(device).multi_processor_count
