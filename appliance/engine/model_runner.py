"""The only place that builds device tensors: loads the model, owns the KV cache, runs a step.

Per step it turns the scheduler's plan into a `StepBatch`, then into flat inputs and AttentionMetadata
(built once, passed down), and returns logits for the sequences that sample. Decode-only steps go
through StaticDecode (engine/cuda_graph.py) when set up. Under tensor parallelism rank 0 broadcasts
each StepBatch and every rank runs `forward` on its shard (parallel/worker.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch

from appliance.config.schema import ApplianceConfig, ConfigError, EngineConfig
from appliance.engine.cuda_graph import StaticDecode
from appliance.engine.kernel_variants import CompileWatch
from appliance.engine.memory import check_weights_fit, lora_buffer_bytes, plan_kv_blocks, weight_bytes
from appliance.engine.piecewise import PiecewiseStep
from appliance.engine.runtime import piecewise_off_reason, resolve_device, resolve_runtime
from appliance.engine.scheduler import SchedulerOutput
from appliance.engine.step import StepBatch, StepInputs
from appliance.models.attention import AttentionMetadata, PrefillSeq, context_groups
from appliance.models.llama import LlamaModel, ModelArgs
from appliance.models.weights import load_model, random_model, read_hf_config
from appliance.parallel.group import SingleRank, TPGroup
from appliance.telemetry.stats import StatsRecorder, StepPath
from kernels.prefill_tiles import prefill_tiles

if TYPE_CHECKING:
    from appliance.lora.layers import LoRAContext
    from appliance.lora.manager import LoRAManager
    from appliance.parallel.launcher import TPLeader

log = logging.getLogger(__name__)

class ModelRunner:
    def __init__(self, cfg: ApplianceConfig, model_path: str, tp: Optional[TPGroup] = None,
                 leader: Optional["TPLeader"] = None,
                 lora: Optional[Callable[["ModelRunner"], "LoRAManager"]] = None,
                 stats: Optional[StatsRecorder] = None) -> None:
        # tp: this rank's tensor-parallel group (None: tp_size 1, a SingleRank: no process group, no collectives).
        # leader: TP rank 0's sender of each step's batch and the decode setup (parallel/launcher.py).
        # lora: builds the LoRA manager over this runner's model, called last (after the KV cache is sized).
        # stats: where `execute` records each step's path; only rank 0 executes, so TP workers record nothing.
        self.leader = leader
        self.stats = stats if stats is not None else StatsRecorder()
        self.tp: TPGroup | SingleRank = tp if tp is not None else SingleRank(resolve_device(cfg.model.device))
        tp = self.tp
        self.device = tp.device
        self.runtime = resolve_runtime(cfg, self.device, tp.size)
        self.dtype = self.runtime.torch_dtype
        hf_cfg = read_hf_config(model_path)
        self.args = ModelArgs.from_hf_config(hf_cfg)
        max_pos = self.args.max_position_embeddings
        want = cfg.model.max_model_len or max_pos
        if want > max_pos:
            raise ConfigError(f"model.max_model_len: {want} exceeds the model's max_position_embeddings {max_pos}")
        sw = self.args.sliding_window
        if sw is not None and want > sw:
            raise ConfigError(f"model.max_model_len: {want} exceeds the model's sliding_window {sw}; sliding-window "
                              f"attention is not implemented, so set model.max_model_len <= {sw}")
        self.max_model_len = want
        self.block_size = cfg.engine.kv_block_size
        if self.device.type == "cuda" and cfg.engine.num_kv_blocks is None:
            # Before loading: weights that alone exceed the budget get an error with the numbers, not an OOM.
            check_weights_fit(torch.cuda.mem_get_info(self.device)[1], cfg.engine.gpu_memory_utilization,
                              weight_bytes(self.args, torch.finfo(self.dtype).bits // 8, tp.size),
                              str(self.dtype).removeprefix("torch."))
        if tp.size > 1:
            from appliance.parallel.layout import TPLayout
            from appliance.parallel.shard import load_shard

            TPLayout.check(self.args, tp.size)
            self.model = load_shard(model_path, TPLayout(self.args, tp.rank, tp.size), tp, self.dtype, self.device,
                                    self.max_model_len, cfg.model.init, cfg.model.seed)
        elif cfg.model.init == "random":
            self.model: LlamaModel = random_model(model_path, self.dtype, self.device, self.max_model_len,
                                                  cfg.model.seed)
        else:
            self.model = load_model(model_path, self.dtype, self.device, self.max_model_len)
        self.attention_backend = self.runtime.attention_backend
        # engine.prefill_attention_kernel: the step's prefill chunks in one Triton launch a layer (else SDPA per chunk).
        self.prefill_kernel = self.attention_backend == "triton" and cfg.engine.prefill_attention_kernel
        self.fused_kernels = self.runtime.fused_kernels
        self.model.use_fused_kernels(self.fused_kernels == "triton")
        self._sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                     if self.device.type == "cuda" else 0)
        self.num_blocks = tp.min_int(self._num_kv_blocks(cfg))  # block ids mean the same on every rank
        a = self.model.args  # this rank's heads (all of them without TP)
        # One tensor for the whole cache: [layers, k|v, blocks + 1, block_size, kv_heads, head_dim]. The
        # last block is nobody's: the padding rows of a static decode batch write their K/V there.
        self.pad_block = self.num_blocks
        self.kv_cache = torch.zeros(a.num_layers, 2, self.num_blocks + 1, self.block_size, a.num_kv_heads,
                                    a.head_dim, dtype=self.dtype, device=self.device)
        # Decode-only steps over static buffers (CUDA graphs on cuda); set up by setup_decode_graphs.
        self.static_decode: Optional[StaticDecode] = None
        # Steps with prefills of up to its largest size (graphs between attentions); set up by setup_piecewise_graphs.
        self.piecewise: Optional[PiecewiseStep] = None
        # Set by watch_compiles once the start-up warm-up compiled the kernels: eager steps then log what it missed.
        self.compile_watch: Optional[CompileWatch] = None
        self.lora: Optional["LoRAManager"] = lora(self) if lora is not None else None
        log.info("model on %s in %s; KV cache %d blocks x %d tokens (%.2f GiB); fused kernels %s", self.device,
                 self.dtype, self.num_blocks, self.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**30, self.fused_kernels)

    def watch_compiles(self) -> None:
        """From now on, eager steps log the kernel variants they compile (the warm-up should have)."""
        self.compile_watch = CompileWatch()

    def bytes_per_block(self) -> int:
        a = self.model.args
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * torch.finfo(self.dtype).bits // 8

    def _num_kv_blocks(self, cfg: ApplianceConfig) -> int:
        e = cfg.engine
        if e.num_kv_blocks is not None:
            return e.num_kv_blocks
        # No point holding more than every sequence at full length needs.
        cap = e.max_num_seqs * ((self.max_model_len + self.block_size - 1) // self.block_size)
        if self.device.type != "cuda":
            n = min(int(e.kv_cache_memory_gib * 2**30 // self.bytes_per_block()), cap)
            if n < 1:
                raise ConfigError("engine.kv_cache_memory_gib: no room for one KV block; raise it or set "
                                  "engine.num_kv_blocks")
            return n
        # As vLLM's profile run: the largest eager step and the largest decode graph batch run once on a
        # scratch cache, so the KV cache gets what is left of gpu_memory_utilization after their peaks.
        step_peak = self._profile_peak(self._profile_batch(min(e.max_num_batched_tokens, self.max_model_len),
                                                           e.max_num_seqs))
        graphs = 0 if not self.runtime.decode_graphs else self._profile_peak(
            self._profile_batch(0, max(e.graph_batch_sizes())))
        pieces = e.piecewise_sizes(self.device.type)
        if piecewise_off_reason(self.runtime, self.tp.size, pieces) is None:
            # Their shared pool holds one piece's transients at the largest size; a whole step's peak bounds it.
            t = min(max(pieces), self.max_model_len)
            graphs += self._profile_peak(self._profile_batch(t, min(e.max_num_seqs, t)))
        lora = 0
        if cfg.lora.enabled:  # its slot buffers are allocated after sizing (lora/layers.py)
            lora = lora_buffer_bytes(self.args, list(cfg.lora.resolved_targets()), cfg.lora.max_loras_per_batch,
                                     cfg.lora.max_lora_rank, torch.finfo(self.dtype).bits // 8,
                                     self.tp.size)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        plan = plan_kv_blocks(total, free - lora, e.gpu_memory_utilization, step_peak, graphs,
                              self.bytes_per_block(), cap)
        log.info("device memory: %s", plan.describe())
        return plan.num_blocks

    def _profile_batch(self, prefill_tokens: int, decode_rows: int) -> StepBatch:
        """The worst step of its kind: a prefill chunk of `prefill_tokens` ending at max_model_len (the
        widest attention) sampling `decode_rows` rows, or (0 tokens) `decode_rows` decode rows at
        max_model_len. Block tables point into the scratch cache of `_profile_peak`."""
        bs, ctx = self.block_size, self.max_model_len
        table = list(range(-(-ctx // bs)))
        slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
        if prefill_tokens:
            pos = list(range(ctx - prefill_tokens, ctx))
            rows = min(decode_rows, prefill_tokens)
            return StepBatch([0] * prefill_tokens, pos, [slot(p) for p in pos], [(0, prefill_tokens, pos[0], table)],
                             prefill_tokens, [], [], list(range(prefill_tokens - rows, prefill_tokens)))
        return StepBatch([0] * decode_rows, [ctx - 1] * decode_rows, [slot(ctx - 1)] * decode_rows, [], 0,
                         [table] * decode_rows, [ctx] * decode_rows, list(range(decode_rows)))

    @torch.inference_mode()
    def _profile_peak(self, batch: StepBatch) -> int:
        """Bytes the step allocates above what is held now (forward, logits, a sampler's sort), run
        once on a scratch KV cache of one max_model_len sequence. Under TP every rank runs the same
        profile at the same point, so the model's collectives pair up."""
        a = self.model.args
        blocks = -(-self.max_model_len // self.block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.kv_cache = torch.zeros(a.num_layers, 2, blocks + 1, self.block_size, a.num_kv_heads, a.head_dim,
                                    dtype=self.dtype, device=self.device)
        scratch = torch.cuda.memory_allocated(self.device) - before
        x = self.inputs(batch)
        hidden = self.model(x.input_ids, x.positions, self.kv_cache, x.meta)
        probs = self.model.compute_logits(hidden[x.logits_indices]).float().softmax(-1)
        torch.sort(probs, dim=-1, descending=True)  # top-p/top-k sort their rows
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - scratch
        del self.kv_cache, x, hidden, probs
        return peak

    def setup_decode_graphs(self, e: EngineConfig) -> None:
        """Capture the decode graphs when they apply; called by the engine once LoRA is wired."""
        why = self.runtime.decode_graphs_off
        if why is not None:
            log.info("decode steps run eagerly: %s", why)
            return
        self.start_static_decode(e.graph_batch_sizes(), capture=True)

    def start_static_decode(self, sizes: list[int], capture: bool, lora: Optional["LoRAContext"] = None) -> None:
        """Decode-only steps of up to max(sizes) sequences over static buffers from now on, replayed as
        CUDA graphs when `capture`. TP rank 0 tells the other ranks first, which call this with their
        own LoRA context (`lora`; rank 0 and tp_size 1 use the manager's)."""
        if self.leader is not None:
            self.leader.setup_decode(sizes, capture)
        self.static_decode = StaticDecode(self, sizes, capture, lora)

    def setup_piecewise_graphs(self, e: EngineConfig) -> None:
        """Capture the piecewise graphs of steps with prefills when they apply (engine.piecewise_graph_tokens)."""
        sizes = e.piecewise_sizes(self.device.type)
        why = piecewise_off_reason(self.runtime, self.tp.size, sizes)
        if why is not None:
            log.info("steps with prefills run eagerly: %s", why)
            return
        self.start_piecewise(sizes, capture=True)

    def start_piecewise(self, sizes: list[int], capture: bool) -> None:
        """Steps of up to max(sizes) tokens that are not static decode steps run piecewise from now on,
        over static buffers (engine/piecewise.py), replayed as CUDA graphs when `capture`."""
        if self.tp.size > 1:
            raise ValueError("piecewise steps are not available under tensor parallelism")
        self.piecewise = PiecewiseStep(self, sizes, capture)

    def release_static_decode(self) -> None:
        """Free the decode graphs (before a TP process group is destroyed: StaticDecode.release)."""
        if self.static_decode is not None:
            self.static_decode.release()
            self.static_decode = None
        if self.piecewise is not None:
            self.piecewise.release()
            self.piecewise = None

    def decode_splits(self, batch: int, len_bound: int) -> int:
        """Split-K parts of the Triton decode kernel: 1 unless the batch's programs fill at most a
        quarter of the SMs, else 512-token parts of the length bound (at most 64). Host ints only."""
        programs = batch * self.model.args.num_kv_heads  # this rank's KV heads
        if self._sms == 0 or programs == 0 or 4 * programs > self._sms:
            return 1  # cpu, a step without decodes, or enough programs already
        return max(1, min(64, -(-len_bound // 512)))

    # ------------------------------------------------------------------ one step
    def host_batch(self, plan: SchedulerOutput, allow_pending: bool = False) -> StepBatch:
        """Flatten the plan: prefill chunks first, then one token per decoding sequence. allow_pending:
        a decode whose input token is not known on the host yet (async scheduling) gets id -1."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        prefills: list[tuple[int, int, int, list[int]]] = []
        bs = self.block_size
        for s in plan.prefills:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            q_start = len(ids)
            ids.extend(seq.token_slice(start, end))
            pos.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            prefills.append((q_start, s.num_new_tokens, start, list(seq.block_table)))
            if s.samples:
                logits_idx.append(len(ids) - 1)
        num_prefill_tokens = len(ids)
        max_blocks = max((len(s.seq.block_table) for s in plan.decodes), default=0)
        tables: list[list[int]] = []
        ctx_lens: list[int] = []
        for s in plan.decodes:
            seq = s.seq
            p = seq.num_computed_tokens
            ids.append(-1 if allow_pending and seq.is_pending(p) else seq.token_at(p))
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
            ctx_lens.append(p + 1)
            logits_idx.append(len(ids) - 1)
        return StepBatch(ids, pos, slots, prefills, num_prefill_tokens, tables, ctx_lens, logits_idx)

    def inputs(self, b: StepBatch) -> StepInputs:
        """The step's device tensors, built once."""
        dev = self.device
        return StepInputs(
            input_ids=torch.tensor(b.input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(b.positions, dtype=torch.long, device=dev),
            meta=self.attention_meta(b),
            logits_indices=torch.tensor(b.logits_indices, dtype=torch.long, device=dev),
        )

    def attention_meta(self, b: StepBatch) -> AttentionMetadata:
        """The step's AttentionMetadata over its real rows (the eager step's, and the piecewise step's)."""
        dev = self.device
        max_blocks = len(b.decode_tables[0]) if b.decode_tables else 0
        kernel = self.prefill_kernel
        group = self.model.args.num_heads // self.model.args.num_kv_heads  # this rank's query heads per KV head
        return AttentionMetadata(
            slot_mapping=torch.tensor(b.slot_mapping, dtype=torch.long, device=dev),
            prefills=[PrefillSeq(q0, n, ctx, None if kernel else torch.tensor(table, dtype=torch.long, device=dev))
                      for q0, n, ctx, table in b.prefills],
            num_prefill_tokens=b.num_prefill_tokens,
            decode_block_tables=torch.tensor(b.decode_tables, dtype=torch.long,
                                             device=dev).view(len(b.decode_tables), max_blocks),
            decode_context_lens=torch.tensor(b.decode_context_lens, dtype=torch.long, device=dev),
            decode_max_len=max(b.decode_context_lens, default=0),
            attention_backend=self.attention_backend,
            decode_splits=self.decode_splits(len(b.decode_context_lens), max(b.decode_context_lens, default=0)),
            decode_len_bound=max(b.decode_context_lens, default=0),
            context_groups=context_groups(b.prefills, self.block_size, dev) if not kernel else [],
            prefill_tiles=prefill_tiles(b.prefills, self.block_size, group, dev) if kernel else None,
        )

    def runs_static(self, plan: SchedulerOutput) -> bool:
        """The plan runs over the static decode buffers (decode-only, a captured size)."""
        sd = self.static_decode
        return sd is not None and not plan.prefills and sd.size_for(len(plan.decodes)) is not None

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, sources: Optional[list[int]] = None) -> torch.Tensor:
        """Run one step; logits [N, vocab] (model dtype) for the sampling sequences, prefills then decodes.
        sources: for a static step, where each decode row's pending input token is (StaticDecode.run)."""
        if self.lora is not None:
            # LLMEngine.step already loaded plan.slot_loads; direct callers (tests) load here, all or nothing.
            failed = self.lora.ensure_loaded(plan.slot_loads)
            if failed:
                raise RuntimeError(f"adapter weights could not be loaded: {failed}")
        sd = self.static_decode
        if sd is not None and self.runs_static(plan):
            # Fills the LoRA info itself (fixed per-row layout); under TP sends the staged rows first.
            out = self._on_all_ranks(lambda: sd.run(plan, sources))
            self.stats.step("graph", len(plan.decodes))
            return out
        batch = self.host_batch(plan)
        steps = plan.prefills + plan.decodes  # the order host_batch() flattens them in
        pw = self.piecewise
        if pw is not None and pw.size_for(len(batch.input_ids)) is not None:
            # Over the static buffers; the LoRA layout is built on the device from each token's slot.
            token_slots = None
            if self.lora is not None:
                seg_slots = self.lora.step_slots([s.seq.adapter for s in steps])
                token_slots = [sl for s, sl in zip(steps, seg_slots) for _ in range(s.num_new_tokens)]
            run: Callable[[], torch.Tensor] = lambda: pw.run(batch, token_slots)  # noqa: E731
            path: StepPath = "piecewise"
        else:
            if self.lora is not None:
                batch.lora = self.lora.begin_step([s.num_new_tokens for s in steps],
                                                  [s.seq.adapter for s in steps])
            run = lambda: self._run(batch)  # noqa: E731
            path = "eager"
        t0 = time.perf_counter()
        out = run()
        self.stats.step(path, len(batch.input_ids))
        if self.compile_watch is None:
            return out
        new = self.compile_watch.new_since_last()
        if new:
            log.warning("a step compiled %d Triton kernel variant(s) the start-up warm-up did not (%.1f s that "
                        "its requests wait): %s; the step: prefill chunks %s, %d decode rows, adapters %s",
                        len(new), time.perf_counter() - t0, "; ".join(new), [s.num_new_tokens for s in plan.prefills],
                        len(plan.decodes), sorted({str(s.seq.adapter) for s in steps if s.seq.adapter is not None}))
        return out

    def _run(self, batch: StepBatch) -> torch.Tensor:
        """The model over `batch` on every rank: rank 0 broadcasts it first under tensor parallelism."""

        def step() -> Optional[torch.Tensor]:
            if self.leader is not None:
                self.leader.broadcast_step(batch)
            return self.forward(batch)

        return self._on_all_ranks(step)

    def _on_all_ranks(self, step: Callable[[], Optional[torch.Tensor]]) -> torch.Tensor:
        """Run a step; under TP a failure on rank 0 ends every rank (TPGroup.in_step)."""
        out = self.tp.in_step(step)
        assert out is not None
        return out

    @torch.inference_mode()
    def warm_step(self, batch: StepBatch, seg_lens: list[int], seg_slots: list[int]) -> None:
        """One synthetic step of the start-up warm-up (engine/warmup.py): `batch` with the LoRA layout of
        its sequences (slot per sequence, -1 = base; ignored when LoRA is off); the logits are dropped."""
        if self.lora is not None:
            batch.lora = self.lora.use_layout(seg_lens, seg_slots)
        try:
            self._run(batch)
        finally:
            if self.lora is not None:
                self.lora.ctx.info = None

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> Optional[torch.Tensor]:
        """The model over one step: logits [N, vocab] (model dtype) (None on TP ranks other than 0, which
        only take part in the collectives)."""
        x = self.inputs(batch)
        hidden = self.model(x.input_ids, x.positions, self.kv_cache, x.meta)
        logits = self.model.compute_logits(hidden[x.logits_indices])
        return self.tp.gather_last_dim(logits)
