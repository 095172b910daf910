"""StaticDecode: decode-only steps over static buffers, replayed as CUDA graphs (one per batch size).

A decode step of n sequences is padded to the smallest captured size b >= n. Everything the forward
reads lives in buffers allocated once for the largest size; a step only copies its values in (from
pinned staging, no host wait) and replays, so nothing in the graph depends on a host integer of this
step. Input ids are gathered inside the graph from staging or the last step's samples (`publish`), so
async scheduling can decode on tokens the host has not read yet. Hazards: adapter loads must copy
into the A/B slot tensors and `slot_ranks`, never replace them (that would invalidate the graphs);
padding rows write K/V only into ModelRunner.pad_block. Under TP every rank captures the same sizes in
the same order and followers replay what rank 0 stages (`follow`). Details: docs/architecture.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol

import torch

from appliance.engine.scheduler import SchedulerOutput
from appliance.engine.step import StepBatch, padded_size
from appliance.lora.batch import LoRABatchInfo
from appliance.lora.layers import LoRAContext
from appliance.models.attention import AttentionMetadata
from appliance.parallel.group import TPGroup
from kernels.segments import LoRASegments, sorted_segments_device

if TYPE_CHECKING:
    from appliance.lora.manager import LoRAManager
    from appliance.models.llama import LlamaModel
    from appliance.parallel.group import DecodeHeader, SingleRank

log = logging.getLogger(__name__)


class DecodeRunner(Protocol):
    """What StaticDecode reads of the runner that owns it (ModelRunner), so this file need not import it."""

    device: torch.device
    model: "LlamaModel"
    kv_cache: torch.Tensor
    block_size: int
    max_model_len: int
    pad_block: int
    attention_backend: str
    lora: Optional["LoRAManager"]
    tp: "TPGroup | SingleRank"

    def decode_splits(self, batch: int, len_bound: int) -> int: ...

    def host_batch(self, plan: SchedulerOutput, allow_pending: bool = False) -> StepBatch: ...


@dataclass
class DecodeBuffers:
    """Static device buffers for the largest batch size Bm; a size b uses the first b rows."""

    # Input ids = tokens[token_index[:b]]: rows [0, Bm) the last step's samples (on the device), [Bm, 2 Bm) staged ids.
    tokens: torch.Tensor  # [2 Bm] long
    token_index: torch.Tensor  # [Bm] long: the row of `tokens` each input row reads
    positions: torch.Tensor  # [Bm] long
    slot_mapping: torch.Tensor  # [Bm] long: cache slot of each row's new K/V
    context_lens: torch.Tensor  # [Bm] int32: tokens in the cache incl. this step's (0 = padding)
    block_tables: torch.Tensor  # [Bm, max_blocks_per_seq] int32
    lora_slots: torch.Tensor  # [Bm] int32: slot of each row, -1 = base or padding
    seg_starts: torch.Tensor  # [Bm] int32 = arange: one LoRA segment per row
    seg_lens: torch.Tensor  # [Bm] int32 = 1
    slot_ranks: torch.Tensor  # [S] int32: rank of each LoRA slot (0 = empty)


# Sorted decode (engine/runtime.py): sizes with this many rows per slot sort rows by slot in the graph (tuned).
SORTED_MIN_ROWS_PER_SLOT = 4


@dataclass(frozen=True)
class DecodeStep:
    """The shape of one staged step: what TP rank 0 sends (as ints) ahead of the staged rows."""

    size: int  # b: the captured size it is padded to
    n: int  # real rows (sequences)
    ncols: int  # block-table columns staged (the longest sequence's blocks)
    max_len: int  # longest context; read only by the uncaptured step's torch attention
    with_lora: int  # 1: some row has an adapter (the graph with LoRA launches); 0: all rows base

    def ints(self) -> list[int]:
        return [self.size, self.n, self.ncols, self.max_len, self.with_lora]


class StaticDecode:
    def __init__(self, runner: DecodeRunner, sizes: list[int], capture: bool,
                 lora: Optional[LoRAContext] = None) -> None:
        """lora: the wrapped model's LoRA context (None = LoRA off). Rank 0 (and tp_size 1) also needs
        runner.lora, the manager that maps each sequence's adapter to its slot."""
        if not sizes or any(b < 1 for b in sizes):
            raise ValueError(f"static decode batch sizes must be >= 1, got {sizes}")
        self.runner = runner
        self.sizes = sorted(set(sizes))
        self.capture = capture
        if lora is None and runner.lora is not None:
            lora = runner.lora.ctx  # never None while the model has LoRA layers: stale info would be read
        self.lora = lora
        dev = runner.device
        bm = self.sizes[-1]
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        num_slots = lora.num_slots if lora is not None else 0
        i32 = dict(dtype=torch.int32, device=dev)
        self.buf = DecodeBuffers(
            tokens=torch.zeros(2 * bm, dtype=torch.long, device=dev),
            token_index=torch.arange(bm, 2 * bm, dtype=torch.long, device=dev),
            positions=torch.zeros(bm, dtype=torch.long, device=dev),
            slot_mapping=torch.zeros(bm, dtype=torch.long, device=dev),
            context_lens=torch.zeros(bm, **i32),
            block_tables=torch.zeros(bm, self.max_blocks, **i32),
            lora_slots=torch.full((bm,), -1, **i32),
            seg_starts=torch.arange(bm, **i32),
            seg_lens=torch.ones(bm, **i32),
            slot_ranks=torch.zeros(num_slots, **i32),
        )
        # Two pinned staging sets in turn: under async scheduling a step's copies must not wait for the last one's.
        pin = dev.type == "cuda"
        self._h64s = [torch.zeros(4 * bm, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._h32s = [torch.zeros(2 * bm + num_slots + bm * self.max_blocks, dtype=torch.int32, pin_memory=pin)
                      for _ in range(2)]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]  # the last copy out of each set
        self._set = 0  # the staging set of the step being staged or launched
        # (size, with LoRA launches) -> graph; without LoRA on, only the False variant exists.
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}  # -> [b, vocab] in the model dtype, written by its graph
        if capture:
            self._capture_all()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> Optional[int]:
        """The padded size of a decode step of n sequences; None = too large, run it eagerly."""
        return padded_size(self.sizes, n)

    # ------------------------------------------------------------------ one step
    def run(self, plan: SchedulerOutput, sources: Optional[list[int]] = None) -> torch.Tensor:
        """Logits [n, vocab] (model dtype) of a decode-only plan of n <= max_size sequences (rank 0 under TP:
        the other ranks get the staged rows first and replay with it). sources[i] >= 0: row i's input
        token is row sources[i] of the last `publish`ed tokens (not known on the host yet)."""
        n = len(plan.decodes)
        b = self.size_for(n)
        if plan.prefills or b is None:
            raise ValueError(f"static decode takes decode-only steps of at most {self.max_size} sequences")
        step = self._stage(plan, b, sources)
        self.runner.tp.broadcast_decode(step.ints(), self._staged(step))  # a no-op at tp_size 1
        logits = self._launch(step)
        assert logits is not None
        return logits[:n]

    @torch.inference_mode()
    def follow(self, head: "DecodeHeader") -> None:
        """A TP rank other than 0: take rank 0's staged rows of the step `head` announced and run it."""
        tp = self.runner.tp
        assert isinstance(tp, TPGroup) and tp.rank != 0
        step = DecodeStep(*head.fields)
        self._next_staging()
        tp.receive_into(head, self._staged(step))
        self._launch(step)

    def publish(self, tokens: torch.Tensor) -> None:
        """The tokens sampled from this step's rows (long [n], on the device): the next step's rows
        may name them as sources (async scheduling). Queued on the device, no host sync."""
        self.buf.tokens[:tokens.shape[0]].copy_(tokens)

    def _next_staging(self) -> None:
        """Take the other staging set, once the copies out of it (two steps ago) have left."""
        self._set ^= 1
        done = self._copied[self._set]
        if done is not None:
            done.synchronize()

    def _staged(self, step: DecodeStep) -> list[torch.Tensor]:
        """The staging rows a step uses: [ids | positions | slot mapping | token index] and [context
        lens | lora slots | slot ranks | the n x ncols tables]."""
        b = step.size
        return [self._h64s[self._set][:4 * b],
                self._h32s[self._set][:2 * b + len(self.buf.slot_ranks) + step.n * step.ncols]]

    def _stage(self, plan: SchedulerOutput, b: int, sources: Optional[list[int]] = None) -> DecodeStep:
        """Write the step into the staging buffers for b rows; padding rows go to the pad block."""
        r = self.runner
        bs = r.block_size
        pad_slot = r.pad_block * bs
        # decode-only: one row per sequence, tables padded to the longest; -1 = an id still on the device
        hb = r.host_batch(plan, allow_pending=True)
        ids, pos, slots, ctx, tables = (hb.input_ids, hb.positions, hb.slot_mapping, hb.decode_context_lens,
                                        hb.decode_tables)
        use_lora = self.lora is not None
        if use_lora and r.lora is None:
            raise RuntimeError("static decode with LoRA stages its steps through the LoRA manager (rank 0)")
        lora_slots = r.lora.step_slots([s.seq.adapter for s in plan.decodes]) if use_lora else []
        n = len(ids)
        pad = b - n
        ncols = len(tables[0])
        bm = self.max_size
        index = list(range(bm, bm + b))
        for i, tok in enumerate(ids):
            if tok < 0:
                src = -1 if sources is None else sources[i]
                if src < 0:
                    raise ValueError(f"decode row {i}: its input token is pending and no source row was given")
                index[i], ids[i] = src, 0
        self._next_staging()
        h64, h32 = self._h64s[self._set], self._h32s[self._set]
        h64[:4 * b] = torch.tensor(ids + [0] * pad + pos + [0] * pad + slots + [pad_slot] * pad + index,
                                   dtype=torch.long)
        ranks = r.lora.slot_ranks if use_lora else []
        head = ctx + [0] * pad + (lora_slots + [-1] * pad if use_lora else [-1] * b) + list(ranks)
        h32[:len(head)] = torch.tensor(head, dtype=torch.int32)
        flat = [v for t in tables for v in t]
        h32[len(head):len(head) + n * ncols] = torch.tensor(flat, dtype=torch.int32)
        return DecodeStep(b, n, ncols, max(ctx), int(any(sl >= 0 for sl in lora_slots)))

    def _launch(self, step: DecodeStep) -> Optional[torch.Tensor]:
        """Copy the staged step into the device buffers and run it: logits [b, vocab] (model dtype) (None
        on TP ranks other than 0)."""
        b, n, ncols = step.size, step.n, step.ncols
        h64, h32 = self._h64s[self._set], self._h32s[self._set]
        d = self.buf
        nb = 2 * b + len(d.slot_ranks)
        bm = self.max_size
        d.tokens[bm:bm + b].copy_(h64[:b], non_blocking=True)
        d.positions[:b].copy_(h64[b:2 * b], non_blocking=True)
        d.slot_mapping[:b].copy_(h64[2 * b:3 * b], non_blocking=True)
        d.token_index[:b].copy_(h64[3 * b:4 * b], non_blocking=True)
        d.context_lens[:b].copy_(h32[:b], non_blocking=True)
        d.lora_slots[:b].copy_(h32[b:2 * b], non_blocking=True)
        d.slot_ranks.copy_(h32[2 * b:nb], non_blocking=True)
        d.block_tables[:n, :ncols].copy_(h32[nb:nb + n * ncols].view(n, ncols), non_blocking=True)
        if self.runner.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self._copied[self._set] = done
        with_lora = bool(step.with_lora)
        if self.capture:
            self.graphs[(b, with_lora)].replay()
            return self.logits[(b, with_lora)]
        return self._forward(b, step.max_len, with_lora)

    def _meta(self, b: int, max_len: int) -> AttentionMetadata:
        r = self.runner
        d = self.buf
        return AttentionMetadata(
            slot_mapping=d.slot_mapping[:b], prefills=[], num_prefill_tokens=0,
            decode_block_tables=d.block_tables[:b], decode_context_lens=d.context_lens[:b],
            decode_max_len=max_len, attention_backend=r.attention_backend,
            decode_splits=r.decode_splits(b, r.max_model_len), decode_len_bound=r.max_model_len)

    def sorted_layout(self, b: int) -> bool:
        """Whether size b's LoRA launches take the slot-sorted layout (lora.backend csgmv, or auto on
        CUDA: engine/runtime.py sorted_decode; enough rows a slot)."""
        ctx = self.lora
        return (ctx is not None and ctx.sorted_decode and ctx.num_slots > 0
                and b >= SORTED_MIN_ROWS_PER_SLOT * ctx.num_slots)

    def _lora_info(self, b: int) -> Optional[LoRABatchInfo]:
        if self.lora is None:
            return None
        d = self.buf
        empty = torch.empty(0, dtype=torch.long, device=self.runner.device)
        if self.sorted_layout(b):  # device ops: captured into the graph, run again at each replay
            segs = sorted_segments_device(d.lora_slots[:b], self.lora.num_slots, self.lora.max_chunk_size)
        else:
            segs = LoRASegments(d.seg_starts[:b], d.seg_lens[:b], d.lora_slots[:b], None, 1)
        return LoRABatchInfo(seg_indptr=empty, seg_slots=d.lora_slots[:b], slot_ranks=d.slot_ranks,
                             token_slots=empty, groups=[], segments=segs)

    def _forward(self, b: int, max_len: int, with_lora: bool) -> Optional[torch.Tensor]:
        """The step over the first b rows: logits [b, vocab] (model dtype) (None on TP ranks other than 0,
        whose vocabulary shard goes to rank 0 through the all-gather). with_lora False: no LoRA
        launches (every row is base or padding)."""
        r = self.runner
        if self.lora is not None:
            self.lora.info = self._lora_info(b) if with_lora else None
        d = self.buf
        ids = d.tokens[d.token_index[:b]]
        hidden = r.model(ids, d.positions[:b], r.kv_cache, self._meta(b, max_len))
        logits = r.model.compute_logits(hidden)
        return r.tp.gather_last_dim(logits)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def _capture_all(self) -> None:
        r = self.runner
        d = self.buf
        # Capture inputs: every row a padding row (context 0, pad block, no adapter).
        d.slot_mapping.fill_(r.pad_block * r.block_size)
        d.context_lens.zero_()
        d.lora_slots.fill_(-1)
        pool = None
        # Under TP the collectives are captured too (the warm-up below has set up the communicator).
        mode = r.tp.capture_error_mode
        variants = (True, False) if self.lora is not None else (False,)
        for b in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            for with_lora in variants:  # the same order on every rank (their collectives must match)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # compiles the Triton kernels of this size outside the capture
                        self._forward(b, 1, with_lora)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, capture_error_mode=mode):
                    # None on TP ranks > 0
                    self.logits[(b, with_lora)] = self._forward(b, 1, with_lora)  # type: ignore[assignment]
                if pool is None:
                    pool = g.pool()
                self.graphs[(b, with_lora)] = g
        torch.cuda.synchronize()
        log.info("decode CUDA graphs captured for batch sizes %s", self.sizes)

    def release(self) -> None:
        """Free the graphs. Under TP this must come before the process group is destroyed: NCCL's
        communicator teardown waits for ever while a graph that captured it is alive."""
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.logits.clear()
