"""PiecewiseStep: steps with prefill chunks (mixed with decodes) over static buffers, the model between
attentions replayed as CUDA graphs ("piecewise CUDA graphs", as vLLM calls them).

A step of T tokens is padded to the smallest captured size Tb >= T. Attention depends on the step's
prefill layout (models/attention.py), so it runs eagerly on the real T rows; everything else is cut into
num_layers + 1 pieces per size, each captured once: piece 0 = embedding + layer 0 before attention,
piece i = layer i-1 after attention + layer i before attention (DecoderLayer.after_attention /
before_attention, the halves the eager forward runs too), the last piece ends with the final norm.
Pieces talk through static buffers (the residual stream, rotated q|k|v, the attention output). The
step's inputs are copied in from pinned staging without a host wait; the LoRA layout is csgmv's
slot-sorted chunks built on the device from the per-token slots (kernels/segments.sorted_segments_device,
shapes fixed by Tb), so nothing in a piece reads a host value of this step. Padding rows write their
K/V into ModelRunner.pad_block and are never attended to. Hazards as for StaticDecode: adapter loads
copy into the slot buffers and `slot_ranks`, never replace them. Off under tensor parallelism. With
capture=False (CPU, tests) the same pieces run eagerly over the same buffers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from appliance.engine.step import StepBatch, padded_size
from appliance.lora.batch import LoRABatchInfo
from kernels.segments import sorted_segments_device

if TYPE_CHECKING:
    from appliance.engine.model_runner import ModelRunner
    from appliance.lora.layers import LoRAContext

log = logging.getLogger(__name__)


@dataclass
class PieceBuffers:
    """Static device buffers for the largest size Tm; a step of size Tb uses the first Tb rows."""

    input_ids: torch.Tensor  # [Tm] long
    positions: torch.Tensor  # [Tm] long
    slot_mapping: torch.Tensor  # [Tm] long: cache slot of each row's K/V (padding rows: the pad block)
    logits_index: torch.Tensor  # [Tm] long: rows that sample, first N used
    lora_slots: torch.Tensor  # [Tm] int32: slot of each row, -1 = base or padding
    slot_ranks: torch.Tensor  # [S] int32: rank of each LoRA slot (0 = empty)
    residual: torch.Tensor  # [Tm, H]: the stream before the current layer
    qkv: torch.Tensor  # [Tm, q | k | v]: the current layer's rotated projections (K/V cached)
    attn: torch.Tensor  # [Tm, q_size]: the current layer's attention output (real rows written)
    hidden: torch.Tensor  # [Tm, H]: the final norm's output


class PiecewiseStep:
    def __init__(self, runner: "ModelRunner", sizes: list[int], capture: bool,
                 lora: Optional["LoRAContext"] = None) -> None:
        """sizes: the token counts captured; lora: the wrapped model's LoRA context (None = LoRA off;
        default: the runner's manager's)."""
        if not sizes or any(t < 1 for t in sizes):
            raise ValueError(f"piecewise graph sizes must be >= 1, got {sizes}")
        self.runner = runner
        self.sizes = sorted(set(sizes))
        self.capture = capture
        self.lora = lora if lora is not None else (runner.lora.ctx if runner.lora is not None else None)
        if self.lora is not None and self.lora.backend == "torch":
            raise ValueError("piecewise steps need lora.backend triton or csgmv: the torch backend groups "
                             "tokens on the host per step")
        a = runner.model.args
        dev, dt = runner.device, runner.dtype
        tm = self.sizes[-1]
        num_slots = self.lora.num_slots if self.lora is not None else 0
        self.buf = PieceBuffers(
            input_ids=torch.zeros(tm, dtype=torch.long, device=dev),
            positions=torch.zeros(tm, dtype=torch.long, device=dev),
            slot_mapping=torch.full((tm,), runner.pad_block * runner.block_size, dtype=torch.long, device=dev),
            logits_index=torch.zeros(tm, dtype=torch.long, device=dev),
            lora_slots=torch.full((tm,), -1, dtype=torch.int32, device=dev),
            slot_ranks=torch.zeros(num_slots, dtype=torch.int32, device=dev),
            residual=torch.zeros(tm, a.hidden_size, dtype=dt, device=dev),
            qkv=torch.zeros(tm, a.q_size + 2 * a.kv_size, dtype=dt, device=dev),
            attn=torch.zeros(tm, a.q_size, dtype=dt, device=dev),
            hidden=torch.zeros(tm, a.hidden_size, dtype=dt, device=dev),
        )
        # Two pinned staging sets in turn, as StaticDecode: a step's copies never wait for the last one's.
        pin = dev.type == "cuda"
        self._h64s = [torch.zeros(4 * tm, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._h32s = [torch.zeros(tm + num_slots, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._set = 0
        self._infos: dict[int, LoRABatchInfo] = {}  # size -> its LoRA layout, written by piece 0
        # (size, with LoRA launches) -> one graph per piece (num_layers + 1)
        self.graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        if capture:
            self._capture_all()

    def size_for(self, n: int) -> Optional[int]:
        """The padded size of a step of n tokens; None = too large, run it eagerly."""
        return padded_size(self.sizes, n)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def run(self, batch: StepBatch, token_slots: Optional[list[int]]) -> torch.Tensor:
        """Logits [N, vocab] (model dtype) of the step's sampling rows, as ModelRunner.forward gives them.
        token_slots: the LoRA slot of each of the T tokens (-1 = base); None with LoRA off."""
        r = self.runner
        n = len(batch.input_ids)
        tb = self.size_for(n)
        if tb is None:
            raise ValueError(f"piecewise steps take at most {self.sizes[-1]} tokens, got {n}")
        meta = r.attention_meta(batch)  # before any launch: its small copies find the device idle
        with_lora = self._stage(batch, token_slots, tb)
        m = r.model
        d = self.buf
        for i in range(m.args.num_layers + 1):
            if self.capture:
                self.graphs[(tb, with_lora)][i].replay()
            else:
                self._piece(tb, i, with_lora)
            if i < m.args.num_layers:
                kv = r.kv_cache[i]
                d.attn[:n].copy_(m.layers[i].self_attn.attend(d.qkv[:n], kv[0], kv[1], meta))
        if self.lora is not None:
            self.lora.info = None  # the eager path sets its own per step
        rows = d.hidden[d.logits_index[:len(batch.logits_indices)]]
        return m.compute_logits(rows)

    def _stage(self, b: StepBatch, token_slots: Optional[list[int]], tb: int) -> bool:
        """Copy the step's rows into the buffers (padding rows to the pad block, no adapter); whether
        some row has an adapter (the variant with LoRA launches)."""
        r = self.runner
        n, pad = len(b.input_ids), tb - len(b.input_ids)
        nl = len(b.logits_indices)
        self._set ^= 1
        done = self._copied[self._set]
        if done is not None:
            done.synchronize()  # the copies out of this set two steps ago
        h64, h32 = self._h64s[self._set], self._h32s[self._set]
        pad_slot = r.pad_block * r.block_size
        h64[:3 * tb + nl] = torch.tensor(b.input_ids + [0] * pad + b.positions + [0] * pad + b.slot_mapping
                                         + [pad_slot] * pad + b.logits_indices, dtype=torch.long)
        d = self.buf
        d.input_ids[:tb].copy_(h64[:tb], non_blocking=True)
        d.positions[:tb].copy_(h64[tb:2 * tb], non_blocking=True)
        d.slot_mapping[:tb].copy_(h64[2 * tb:3 * tb], non_blocking=True)
        d.logits_index[:nl].copy_(h64[3 * tb:3 * tb + nl], non_blocking=True)
        with_lora = self.lora is not None and token_slots is not None and any(s >= 0 for s in token_slots)
        if with_lora:
            assert token_slots is not None and r.lora is not None and len(token_slots) == n
            ranks = list(r.lora.slot_ranks)
            h32[:tb + len(ranks)] = torch.tensor(token_slots + [-1] * pad + ranks, dtype=torch.int32)
            d.lora_slots[:tb].copy_(h32[:tb], non_blocking=True)
            d.slot_ranks.copy_(h32[tb:tb + len(ranks)], non_blocking=True)
        if r.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._copied[self._set] = ev
        return with_lora

    def _piece(self, tb: int, i: int, with_lora: bool) -> None:
        """Piece i over the first tb rows: layer i-1 after attention (the embedding for i = 0), then
        layer i before attention (the final norm for i = num_layers), reading and writing the buffers."""
        r = self.runner
        m = r.model
        d = self.buf
        if self.lora is not None:
            if i == 0 and with_lora:  # device ops only: captured into piece 0, read by every piece
                segs = sorted_segments_device(d.lora_slots[:tb], self.lora.num_slots, self.lora.max_chunk_size)
                empty = torch.empty(0, dtype=torch.long, device=r.device)
                self._infos[tb] = LoRABatchInfo(seg_indptr=empty, seg_slots=d.lora_slots[:tb],
                                                slot_ranks=d.slot_ranks, token_slots=empty, groups=[], segments=segs)
            self.lora.info = self._infos[tb] if with_lora else None
        if i == 0:
            x, residual = m.embed_tokens(d.input_ids[:tb]), None
        else:
            x, residual = m.layers[i - 1].after_attention(d.attn[:tb], d.residual[:tb])
        if i == m.args.num_layers:
            d.hidden[:tb].copy_(m.norm(x, residual)[0])
            return
        kv = r.kv_cache[i]
        qkv, residual = m.layers[i].before_attention(x, residual, d.positions[:tb], m.rope, kv[0], kv[1],
                                                     d.slot_mapping[:tb])
        d.qkv[:tb].copy_(qkv)
        d.residual[:tb].copy_(residual)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        d = self.buf
        d.slot_mapping.fill_(self.runner.pad_block * self.runner.block_size)  # every row a padding row
        d.lora_slots.fill_(-1)
        pool = None
        pieces = self.runner.model.args.num_layers + 1
        variants = (True, False) if self.lora is not None else (False,)
        for tb in reversed(self.sizes):  # largest first: the smaller sizes reuse its pool memory
            for with_lora in variants:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # compiles this size's Triton kernels outside the capture
                        for i in range(pieces):
                            self._piece(tb, i, with_lora)
                torch.cuda.current_stream().wait_stream(side)
                graphs = []
                for i in range(pieces):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        self._piece(tb, i, with_lora)
                    if pool is None:
                        pool = g.pool()
                    graphs.append(g)
                self.graphs[(tb, with_lora)] = graphs
        torch.cuda.synchronize()
        if self.lora is not None:
            self.lora.info = None
        log.info("piecewise CUDA graphs captured for step sizes %s (%d pieces each, %s) in %.1f s", self.sizes,
                 pieces, "with and without LoRA" if self.lora is not None else "no LoRA", time.perf_counter() - t0)

    def release(self) -> None:
        for gs in self.graphs.values():
            for g in gs:
                g.reset()
        self.graphs.clear()
        self._infos.clear()
