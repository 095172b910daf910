"""lora_linear: a whole LoRA-wrapped projection for prefill-shaped steps, the delta under the base GEMM.

    y[t] = x[t] @ Wᵀ + scale[slot(t)] * (x[t] @ A[slot(t), i, :r]ᵀ) @ B[slot(t), o_i:o_{i+1}, :r]ᵀ  (slices i)

The add-after order (y = x @ Wᵀ, then lora_expand reads y, adds, writes it back) moves y through
HBM twice more than the base GEMM does; for qkv_proj and o_proj at 16k tokens that alone is
~12-13 % of the GEMM's time on an H200 (docs/benchmarks.md). Here the order is turned round:
lora_shrink (h, fp32), then lora_expand in write mode (y = the delta, written once and never read;
base tokens' rows zeroed), then cuBLAS accumulates the base product into y (beta = 1). A
compute-bound GEMM reads C in its epilogue almost for free, so the delta's cost falls to one write
of y plus the shrink's read of x. (Shrink and expand in one kernel, x read and y written by one
pass, measured no faster on the H200: docs/benchmarks.md, round 3.)

Rounding differs from the add-after order by one step: the delta is rounded to y's dtype when
written, then cuBLAS adds the fp32 base product to it and rounds once (instead of rounding the base
product, then base + delta).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.platform import pdl_available
from kernels.segments import LoRASegments

# Tokens in a step from which the write-then-accumulate order is used on CUDA. H200,
# docs/benchmarks.md: it beat the add-after order (GEMM, then lora_apply) from 64 tokens (the fewest
# measured) up for every Llama-3.1-8B projection, or tied (gate_up_proj at 256); the read of C cost
# cuBLAS about 1 %. Below, the step stays with lora_apply after the GEMM.
MIN_TOKENS_CUDA = 64
# Output width up to which the shrink's K splits leave planes of partial sums (summed by the expand)
# rather than adding atomically into a zeroed h. Every expand program re-reads all planes of its
# rows, and wide outputs have many column programs. H200, docs/benchmarks.md, 64-4096 tokens:
# planes won or tied for qkv/o/down_proj (o 256 tokens 9.0 against 12.3 µs, down 4096 54 against 69),
# atomics for gate_up_proj (28672 columns: 256 tokens 24.5 against 38.8 µs).
PLANES_MAX_OUT = 8192


def lora_linear_pays(num_tokens: int, segs: LoRASegments, device: torch.device) -> bool:
    """Whether a step should run its wrapped projections through lora_linear (host ints only, no sync):
    multi-token segments (prefill-shaped) and, on CUDA, enough tokens for the GEMM to be compute bound.
    On CPU (Triton's interpreter) every prefill-shaped step does, so the CPU tests run this path."""
    if segs.max_len <= 1 or segs.base_rows is None:
        return False
    return device.type != "cuda" or num_tokens >= MIN_TOKENS_CUDA


def lora_linear(x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
                slot_ranks: torch.Tensor, out_offsets: Sequence[int],
                scalings: Optional[torch.Tensor] = None, *, split_k: Optional[int] = None,
                partials: Optional[bool] = None, pdl: Optional[bool] = None) -> torch.Tensor:
    """y = x @ weightᵀ + the multi-LoRA delta of every slice (lora_apply's math), as a new [T, out] tensor.

    x [T, in], weight [out, in] (no bias: the caller keeps the add-after order for biased linears),
    A [S, n, R, in], B [S, out, R], all one dtype (fp32/bf16/fp16); segs from kernels/segments.py's
    builders (they list the base tokens' rows); slot_ranks [S] int32; out_offsets [n + 1];
    scalings [S] fp32 or None. split_k, partials: the shrink's K split (None = its launcher's choice)
    and how the splits combine (True: planes of partial sums, False: atomics; None = planes up to
    PLANES_MAX_OUT output columns); overrides for benchmarks. pdl: the expand launched as a
    programmatic dependent of the shrink (its launch under the shrink's tail; None = where the device
    has PDL).
    """
    y = _new_output("lora_linear", x, weight, B)
    _write_delta(y, x, A, B, segs, slot_ranks, out_offsets, scalings, split_k, partials, pdl)
    return y.addmm_(x, weight.t())  # beta = 1: cuBLAS reads the delta in its epilogue


def _new_output(fn: str, x: torch.Tensor, weight: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The shared argument checks; then y [T, out], uninitialised (the delta's write fills every row)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"{fn}: x must be [T, in] and weight [out, in], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{fn}: weight and x must share a dtype, got {weight.dtype}, {x.dtype}")
    if B.dim() != 3 or B.shape[1] != weight.shape[0]:
        raise ValueError(f"{fn}: B must be [S, {weight.shape[0]}, R], got {tuple(B.shape)}")
    return torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)


def _write_delta(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segs: LoRASegments,
                 slot_ranks: torch.Tensor, out_offsets: Sequence[int], scalings: Optional[torch.Tensor],
                 split_k: Optional[int] = None, partials: Optional[bool] = None,
                 pdl: Optional[bool] = None) -> None:
    """y = the delta of x's rows (lora_shrink, then lora_expand in write mode: base rows zeroed)."""
    if partials is None:
        partials = y.shape[1] <= PLANES_MAX_OUT
    if pdl is None:
        pdl = pdl_available(x.device)
    h = lora_shrink(x, A, segs, slot_ranks, split_k=split_k, partials=partials,
                    launch_dependents=pdl)  # [(P,) T, n, R] fp32
    lora_expand(y, h, B, segs, slot_ranks, out_offsets, scalings, write=True, pdl=pdl)


def lora_linear_pipelined(x: torch.Tensor, weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                          chunks: Sequence[tuple[int, int, LoRASegments]], slot_ranks: torch.Tensor,
                          out_offsets: Sequence[int], scalings: Optional[torch.Tensor] = None, *,
                          side_stream: Optional["torch.cuda.Stream"] = None) -> torch.Tensor:
    """lora_linear over consecutive row chunks, each chunk's delta beside the previous chunk's GEMM.

    chunks: [(lo, hi, segs)] covering rows 0..T in order, segs over the chunk's own rows (row 0 = x's
    row lo; kernels.segments.row_chunks + sgmv_segments build them, base rows listed); other
    arguments as lora_linear's. Returns y = x @ weightᵀ + the delta, a new [T, out] tensor.

    Why: at prefill sizes the base GEMM is compute-bound and leaves most of the memory bandwidth
    idle, while the delta (the shrink's read of x, the expand's write of y) is all memory traffic:
    ~12 % of the GEMM's time for qkv_proj and o_proj at 16k tokens when it runs before it
    (docs/benchmarks.md). Here every chunk's delta (lora_shrink, then lora_expand writing y[lo:hi])
    is queued on `side_stream`, and the current stream runs chunk c's GEMM (accumulating into
    y[lo:hi], beta = 1) once chunk c's delta is done, so chunk c + 1's delta runs while chunk c's
    GEMM does; only the first chunk's delta is exposed. How much overlaps depends on the GEMM
    kernel leaving room on the SMs for the delta's programs. side_stream None (CPU, or no CUDA):
    the same kernels chunk by chunk in one stream (the tests). Same rounding as lora_linear.

    Memory: y is allocated on the current stream before the fork and read there only after each
    chunk's event; h lives and dies on the side stream (each chunk's shrink after the previous
    chunk's expand in stream order); x is read on the side stream only before the events the current
    stream waits on before this returns.
    """
    y = _new_output("lora_linear_pipelined", x, weight, B)
    T = x.shape[0]
    cover = 0
    for lo, hi, _ in chunks:
        if lo != cover or hi <= lo:
            raise ValueError(f"lora_linear_pipelined: chunks must cover rows 0..{T} in order, got "
                             f"{[c[:2] for c in chunks]}")
        cover = hi
    if cover != T:
        raise ValueError(f"lora_linear_pipelined: chunks cover {cover} of {T} rows")
    wt = weight.t()

    def delta(lo: int, hi: int, segs: LoRASegments) -> None:
        _write_delta(y[lo:hi], x[lo:hi], A, B, segs, slot_ranks, out_offsets, scalings)

    if side_stream is None:
        for lo, hi, segs in chunks:
            delta(lo, hi, segs)
            y[lo:hi].addmm_(x[lo:hi], wt)
        return y
    main = torch.cuda.current_stream(x.device)
    side_stream.wait_stream(main)  # x and y are ready
    done = []
    with torch.cuda.stream(side_stream):
        for lo, hi, segs in chunks:
            delta(lo, hi, segs)
            ev = torch.cuda.Event()
            ev.record(side_stream)
            done.append(ev)
    for (lo, hi, _), ev in zip(chunks, done):
        main.wait_event(ev)
        y[lo:hi].addmm_(x[lo:hi], wt)  # beta = 1: this chunk's delta, read in the GEMM's epilogue
    return y
