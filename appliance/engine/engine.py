"""The engine: add requests, abort them, step. One step = schedule, run the model, post-process.

Single-threaded by design; engine/async_engine.py runs it on its own thread for the server.

Failures stay with the requests they concern. An adapter whose weights cannot be read when it is
given a GPU slot (file deleted, truncated or changed on disk since it was registered) fails the
requests of that adapter scheduled in the step; the rest of the step runs. When the model forward of
a step fails, each of its requests is run again alone: those that fail by themselves finish with the
exception's message, the others go on as if nothing happened. An exception in the sampler fails the
whole step (it has advanced). Either way the engine goes on with the next step. With
lora.overlap_loading, a cold adapter is read in the background while steps go on; a read that fails
fails the waiting requests of that adapter, at the start of the next step. The engine never stops itself over
failed steps: a request that triggers a failure could otherwise be sent a few times to take the server
down; a broken device shows as every request failing with its message (logged with the traceback).

Async scheduling (`engine.async_scheduling`, engine/async_step.py): a decode step over the static
buffers is launched and left running; the next call schedules and launches the following step, then
reads the first one's tokens and hands them out while the device runs. A step that cannot run that
way (a prefill, an eager size) first `settle`s: the step in flight is read, so every token is known on
the host. So `step()` returns the tokens of the step before the one it launched; callers loop while
`has_unfinished()`, and call `settle()` before anything that needs a quiet engine (admin operations).
A step with a penalised request (repetition, frequency, presence) or a constrained one (a grammar:
its matcher must accept each token before it fills the next mask) needs the tokens generated so far
on the host: it launches its forward, then reads the step before, then fills the masks while the
forward runs, and samples after.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from appliance.config.schema import ApplianceConfig, ConfigError
from appliance.engine.async_step import LaunchedStep
from appliance.engine.block_manager import BlockManager
from appliance.engine.doorbell import Doorbell
from appliance.engine.grammar.compiler import GrammarCompiler
from appliance.engine.grammar.mask import MaskFiller
from appliance.engine.fair_share import Share
from appliance.engine.model_runner import ModelRunner
from appliance.engine.request import (AdapterNotFoundError, RequestError, RequestOutput, SamplingParams,
                                      TokenLogprob)
from appliance.engine.sampler import DeviceSample, sample_full, sample_on_device
from appliance.engine.scheduler import Scheduler, SchedulerOutput
from appliance.models.weights import read_hf_config
from appliance.engine.sequence import Sequence, SeqStatus
from appliance.telemetry.stats import EngineSnapshot, FinishedRequest, LoRASnapshot, StatsRecorder
from appliance.engine.tokenizer import (
    IdsOnlyTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    find_stop,
    has_tokenizer,
    partial_stop_len,
)
from appliance.engine.warmup import WarmupReport, plan_warmup, run_warmup

if TYPE_CHECKING:
    from appliance.lora.manager import LoRAManager
    from appliance.parallel.launcher import TPLeader

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, cfg: ApplianceConfig) -> None:
        model_path = Path(cfg.model.path).expanduser()
        if not (model_path / "config.json").is_file():
            raise ConfigError(f"model.path: {model_path} is not a model directory (no config.json); "
                              "run `appliance model prepare` (or `make prepare`) for the default model")
        self.cfg = cfg
        self.config = cfg.engine
        self.model_name = cfg.model.name
        # parallel.tp_size > 1: this process is rank 0 and starts the other ranks (appliance/parallel/).
        self.tp: Optional["TPLeader"] = None
        if cfg.parallel.tp_size > 1:
            from appliance.parallel.launcher import start_ranks

            self.tp = start_ranks(cfg, str(model_path))
        try:
            self._build(cfg, model_path)
        except BaseException:
            if self.tp is not None:
                self.tp.kill()  # a worker may be inside a collective rank 0 never joins: no graceful stop
            raise

    def _build(self, cfg: ApplianceConfig, model_path: Path) -> None:
        # Events for metrics, recorded where they happen (here, the scheduler, the LoRA manager); the
        # async engine takes them after every loop iteration. Created first: startup loads count too.
        self.stats = StatsRecorder()
        # Rung by the LoRA manager's background reads; the async engine's loop sleeps on it.
        self.doorbell = Doorbell()
        self.runner = ModelRunner(cfg, str(model_path), tp=None if self.tp is None else self.tp.group, leader=self.tp,
                                  lora=self._lora_manager if cfg.lora.enabled else None, stats=self.stats)
        self.lora: Optional[LoRAManager] = self.runner.lora
        self.tokenizer: Tokenizer | IdsOnlyTokenizer
        if cfg.model.init == "random" and not has_tokenizer(model_path):
            eos = read_hf_config(model_path).get("eos_token_id")
            self.tokenizer = IdsOnlyTokenizer(self.runner.args.vocab_size,
                                              [eos] if isinstance(eos, int) else (eos or []))
        else:
            self.tokenizer = Tokenizer(model_path)
        self.max_model_len = self.runner.max_model_len
        if self.tokenizer.vocab_size > self.runner.args.vocab_size:
            raise ConfigError(f"model.path: tokenizer has {self.tokenizer.vocab_size} tokens but the model "
                              f"only {self.runner.args.vocab_size}")
        # Block management (and the prefix cache) lives on this process alone, also under TP.
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          enable_caching=cfg.engine.enable_prefix_caching, stats=self.stats)
        if self.lora is not None:
            self._load_configured_adapters(cfg)
        overlap = self.lora is not None and cfg.lora.overlap_loading
        self.scheduler = Scheduler(cfg.engine, self.block_manager, self.lora.pool if self.lora else None,
                                   drain_wait_threshold_s=cfg.lora.drain_wait_threshold_s, stats=self.stats,
                                   adapter_ready=self.lora.adapter_ready if overlap else None)  # type: ignore[union-attr]
        self.seqs: dict[str, Sequence] = {}
        # Requests without a seed draw from generators seeded by this one (model.seed), so a restarted
        # server replays the same sequence of unseeded samples.
        self._seed_rng = torch.Generator().manual_seed(cfg.model.seed)
        self.failed_steps = 0  # total, since start
        if cfg.debug.fault_injection_token_id is not None:
            from appliance.telemetry.faults import install_token_fault

            log.warning("debug.fault_injection_token_id=%d: steps whose input holds it will fail (debug)",
                        cfg.debug.fault_injection_token_id)
            install_token_fault(self.runner.model, cfg.debug.fault_injection_token_id)
        # Last: the graphs capture the model as wrapped (LoRA) and with its hooks (no graphs under faults).
        self.runner.setup_decode_graphs(cfg.engine)
        self.runner.setup_piecewise_graphs(cfg.engine)
        # Then the eager steps' kernel variants (the capture compiled the graphs' own).
        self.warmup: Optional[WarmupReport] = None
        if self.runner.runtime.warmup:
            self.warmup = self._warm_up(cfg)
            if self.warmup.compiled is not None:
                self.runner.watch_compiles()
        # Async scheduling applies to steps over the static decode buffers (module docstring); null = on
        # wherever those are set up (cuda graphs) at tp_size 1. Under TP the other ranks would need the
        # sampled tokens, which only rank 0 has (the config check refuses true with tp_size > 1).
        self.async_scheduling = self.runner.runtime.async_scheduling
        self._inflight: Optional[LaunchedStep] = None
        # Structured outputs: built on first use (xgrammar's vocabulary scan takes ~0.4 s).
        self._grammar: Optional[GrammarCompiler] = None
        self._grammar_lock = threading.Lock()
        self._masks: Optional[MaskFiller] = None

    def grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler over this model's vocabulary (thread-safe: the async engine compiles
        in worker threads). RequestError when the model has no tokenizer to build it from."""
        with self._grammar_lock:
            if self._grammar is None:
                if not isinstance(self.tokenizer, Tokenizer):
                    raise RequestError("structured outputs need the model's tokenizer, and this model has none",
                                       param="response_format")
                self._grammar = GrammarCompiler(self.tokenizer.hf, self.runner.args.vocab_size,
                                                self.tokenizer.eos_token_ids, self.config.grammar_cache_size,
                                                self.config.grammar_threads)
            return self._grammar

    def _lora_manager(self, runner: ModelRunner) -> LoRAManager:
        """The LoRA manager over the runner's model (the runner calls this once it sized its KV cache)."""
        # Imported here so a base-only engine never loads the LoRA modules.
        from appliance.lora.manager import LoRAManager as Manager

        cfg = self.cfg
        sync = None
        if self.tp is not None:
            from appliance.parallel.lora import AdapterSync

            sync = AdapterSync(self.tp.group, self.tp.layout)
        return Manager(cfg.lora, runner.runtime.lora, runner.model, cfg.model.name, runner.dtype, runner.device,
                       stats=self.stats, args=runner.args, tp=sync, read_delay_s=cfg.debug.fault_injection_read_delay_s,
                       on_read_done=self.doorbell.ring,
                       # the block manager is built after the runner (it needs the KV size), before any retire
                       on_retire=lambda key: self.block_manager.drop_adapter(key))

    def _warm_up(self, cfg: ApplianceConfig) -> WarmupReport:
        e = cfg.engine
        steps = plan_warmup(e.max_num_batched_tokens, self.max_model_len, e.max_num_seqs,
                            cfg.lora.max_loras_per_batch if self.lora is not None else 0, e.graph_batch_sizes(),
                            eager_decode=self.runner.static_decode is None)
        token = 1 if cfg.debug.fault_injection_token_id == 0 else 0  # never the fault-injection token
        return run_warmup(self.runner, steps, token)

    def _load_configured_adapters(self, cfg: ApplianceConfig) -> None:
        """Load `adapters.*` at start; a bad one stops the start with its key path."""
        from appliance.lora.adapter import AdapterError
        from appliance.lora.registry import LoRAStateError

        assert self.lora is not None
        for name, a in cfg.adapters.items():
            try:
                entry = self.lora.load(name, a.path, pinned=a.pinned)
            except (AdapterError, LoRAStateError) as e:
                raise ConfigError(f"adapters.{name}: {e}") from None
            wrong = a.mismatches(name, entry.rank, entry.target_modules, entry.base_model_name)
            if wrong:
                raise ConfigError("; ".join(wrong))

    @classmethod
    def from_config(cls, cfg: ApplianceConfig) -> "LLMEngine":
        return cls(cfg)

    def close(self, graceful: bool = True) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at tp_size 1). Call it when no step runs;
        `graceful=False` kills them instead (a step may be stuck in a collective). Also stops the LoRA
        loader threads and fetch processes."""
        if self.lora is not None:
            self.lora.close()
        if self.tp is not None:
            tp, self.tp = self.tp, None
            self.runner.release_static_decode()  # graphs that captured NCCL collectives block its teardown
            tp.stop() if graceful else tp.kill()

    # ------------------------------------------------------------------ requests
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request can never be served by this engine."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        vocab = self.runner.args.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})")
        total = n + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.")
        cap = self.block_manager.num_blocks * self.block_manager.block_size
        if total > cap:
            raise RequestError(f"the request needs {total} tokens of KV cache but the cache holds only {cap}")
        if not self.config.enable_chunked_prefill and total > self.config.max_num_batched_tokens:
            raise RequestError(f"the request needs {total} tokens but engine.max_num_batched_tokens is "
                               f"{self.config.max_num_batched_tokens} and chunked prefill is off")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: Optional[float] = None, adapter: Optional[str] = None,
                    prompt_source: Optional[str] = None, share: Optional[Share] = None) -> None:
        """`adapter`: the LoRA adapter as the client named it (name or "<base>:<adapter>"; None or the
        base model's name = base). It is resolved here, on the engine thread, so a reload in place
        between the caller's check and this call gives the request the new weights, and an unload
        gives AdapterNotFoundError. `prompt_source`: the id of an earlier request with the same prompt
        and adapter (another of `n` samples) whose prompt KV this one shares; ignored when that
        request is gone or differs. `share`: its tenant and weight for fair admission (None = the
        flow of requests without a tenant)."""
        params.validate()
        self.check_request(prompt_token_ids, params)
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        key = self._resolve_adapter(adapter)
        if key is not None:
            self.lora.request_added(key)  # type: ignore[union-attr]
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       arrival_time if arrival_time is not None else time.monotonic(), adapter=key,
                       adapter_name=None if key is None else self.lora.name_of(key),  # type: ignore[union-attr]
                       share=share)
        seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens,
                                           params.kept_special_token_ids)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        if not params.greedy:
            seq.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        if params.grammar is not None:  # compiled already when the caller used AsyncEngine.compile_grammar
            seq.matcher = self.grammar_compiler().matcher(params.grammar, params.stop_token_ids)
        src = self.seqs.get(prompt_source) if prompt_source is not None else None
        if src is not None and src.adapter == key and src.prompt_token_ids == seq.prompt_token_ids:
            seq.prompt_source = src
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _resolve_adapter(self, name: Optional[str]) -> Optional[str]:
        """Adapter key (name@generation) for a client-facing adapter name; None = base model."""
        if name is None or name == self.model_name:
            return None
        if self.lora is None:
            raise AdapterNotFoundError(f"The model '{name}' does not exist (LoRA adapters are off: "
                                       "lora.enabled is false).")
        from appliance.lora.registry import LoRAStateError

        try:
            return self.lora.resolve(name)
        except LoRAStateError as e:
            raise AdapterNotFoundError(f"The model '{name}' does not exist: {e.message}") from None

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.status is not SeqStatus.FINISHED:
            self.scheduler.remove(seq)
            self._adapter_done(seq)
            self._record_finished(seq, "abort", time.monotonic())

    def _adapter_done(self, seq: Sequence) -> None:
        if seq.adapter is not None and self.lora is not None:
            self.lora.request_done(seq.adapter)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        outputs = self._take_loads()
        plan = self.scheduler.schedule()
        if not plan.empty:
            outputs += self._load_adapters(plan)
        if plan.empty:
            return outputs + self.settle()
        if self.async_scheduling and self.runner.runs_static(plan):
            return outputs + self._step_async(plan)
        outputs += self.settle()
        if self._drop_finished(plan):
            return outputs
        try:
            logits = self.runner.execute(plan)
        except Exception as e:  # noqa: BLE001 - the failing requests fail (below), the engine goes on
            return outputs + self._isolate(plan, e)
        try:
            sampling, drawn = self._sample(plan, logits)
        except Exception as e:  # noqa: BLE001 - sampling already advanced the step: fail all of it
            return outputs + self._fail_step(plan, e)
        return outputs + self._append_tokens(sampling, *drawn)

    def settle(self) -> list[RequestOutput]:
        """Read the tokens of the step still in flight (async scheduling) and hand them out; after it
        every sampled token is known on the host and the device has no step of ours queued."""
        launched, self._inflight = self._inflight, None
        return [] if launched is None else self._resolve(launched)

    def _step_async(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Launch `plan` (decode-only, static buffers), then hand out the tokens of the step before.
        A plan whose sampling reads every token so far (a grammar, penalties) reads the step before
        first, while its forward runs, and is sampled after (masks filled during the forward)."""
        prev = self._inflight
        sources = None if prev is None else prev.source_rows([s.seq for s in plan.decodes])
        try:
            logits = self.runner.execute(plan, sources)
        except Exception as e:  # noqa: BLE001 - as in step(): run its requests alone
            outputs = self.settle()
            return outputs + ([] if self._drop_finished(plan) else self._isolate(plan, e))
        try:
            sampling = self._advance(plan)  # before the read: a sequence it finishes frees its blocks
        except Exception as e:  # noqa: BLE001 - the step advanced: fail it (after the one before)
            return self.settle() + self._fail_step(plan, e)
        outputs: list[RequestOutput] = []
        if prev is not None and self._reads_history(plan):
            # The device has queued step N's tokens before this forward: read them now, while it runs.
            self._inflight = None
            outputs, prev = self._resolve(prev), None
        try:
            drawn = self._draw(sampling, logits, sample_on_device)
            self.runner.static_decode.publish(drawn.tokens)  # type: ignore[union-attr]
            launched = LaunchedStep.start(sampling, drawn)
        except Exception as e:  # noqa: BLE001 - the step advanced: fail it (after the one before)
            return outputs + self.settle() + self._fail_step(plan, e)
        for seq in sampling:
            seq.num_pending += 1
            p = seq.params
            if len(seq.output_token_ids) + seq.num_pending >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finishing = True  # its pending token is its last: never scheduled again
        self._inflight = launched
        return outputs + ([] if prev is None else self._resolve(prev))

    def _resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Append a launched step's tokens. A sequence that finished meanwhile (aborted, or ended on
        a stop at the step before) drops its token; a device error fails the step's requests."""
        try:
            tokens, logprobs = launched.tokens()
        except Exception as e:  # noqa: BLE001 - as a failed sampling: its requests fail, the engine goes on
            live = [q for q in launched.sampling if q.status is not SeqStatus.FINISHED]
            return self._fail_seqs(live, e)
        now = time.monotonic()
        outputs = []
        for i, (seq, tok) in enumerate(zip(launched.sampling, tokens)):
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_pending -= 1
            out = self._append_token(seq, tok, now, None if logprobs is None else logprobs[i])
            if out is not None:
                outputs.append(out)
        return outputs

    @staticmethod
    def _reads_history(plan: SchedulerOutput) -> bool:
        """Some request of the step is penalised or constrained: its sampling reads every token
        generated so far (the penalties' counts, the grammar matcher's state)."""
        return any(s.seq.params.penalized or s.seq.matcher is not None for s in plan.decodes + plan.prefills)

    @staticmethod
    def _drop_finished(plan: SchedulerOutput) -> bool:
        """Take out of `plan` the sequences that finished since it was scheduled (while `settle` read
        the step before); True when nothing is left to run. Their cache slots were freed: they must
        not run."""
        plan.prefills = [s for s in plan.prefills if s.seq.status is not SeqStatus.FINISHED]
        plan.decodes = [s for s in plan.decodes if s.seq.status is not SeqStatus.FINISHED]
        return plan.empty

    def _isolate(self, plan: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        """A forward over several requests failed: run each alone, so that only the ones that fail by
        themselves get the error and a bad request cannot take its batch down with it. Safe because
        the failed forward advanced nothing: each request recomputes the same positions, and a K/V
        the failed pass wrote is written again with the same value."""
        steps = plan.prefills + plan.decodes
        if len(steps) == 1:
            return self._fail_step(plan, e)
        log.warning("engine step of %d requests failed (%s: %s); running each alone", len(steps),
                    type(e).__name__, e)
        outputs: list[RequestOutput] = []
        for s in steps:
            one = SchedulerOutput(prefills=[s] if s in plan.prefills else [], decodes=[s] if s in plan.decodes else [])
            try:
                logits = self.runner.execute(one)
            except Exception as e1:  # noqa: BLE001 - this request fails by itself
                outputs += self._fail_step(one, e1)
                continue
            outputs += self._postprocess(one, logits)
        return outputs

    def _load_adapters(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Put the weights of adapters newly given a slot into it. An adapter that cannot be read fails
        its requests in this step (taken out of `plan`) and gives its slot back; nothing else changes."""
        if self.lora is None or not plan.slot_loads:
            return []
        started = time.monotonic()
        loading = {key for _, key in plan.slot_loads}
        failed = self.lora.ensure_loaded(plan.slot_loads)
        plan.slot_loads = []
        ended = time.monotonic()
        for s in plan.prefills:  # their step waited for these reads and copies
            if s.seq.adapter in loading and s.seq.load_wait_start is None:
                s.seq.load_wait_start, s.seq.load_wait_end = started, ended
        if not failed:
            return []
        outputs, now = [], time.monotonic()
        for part in (plan.prefills, plan.decodes):
            for s in [s for s in part if s.seq.adapter in failed]:
                part.remove(s)
                name = s.seq.adapter.rpartition("@")[0]  # type: ignore[union-attr]
                log.error("request %s: adapter %r failed to load: %s", s.seq.request_id, name,
                          failed[s.seq.adapter])  # type: ignore[index]
                outputs.append(self._finish(s.seq, "error", now,
                                            f"adapter {name!r} could not be loaded: {failed[s.seq.adapter]}"))
        for key in failed:
            self.lora.load_failed(key)  # its requests released the slot above; free it for anyone
        return outputs

    def _take_loads(self) -> list[RequestOutput]:
        """Overlap loading: take in the background reads finished since the last step; a failed read
        fails the waiting requests of its adapter (as a failed inline read does), nothing else."""
        if self.lora is None:
            return []
        failed = self.lora.poll_loads()
        if not failed:
            return []
        outputs, now = [], time.monotonic()
        for seq in [q for q in self.scheduler.waiting if q.adapter in failed]:
            name = self.lora.name_of(seq.adapter)  # type: ignore[arg-type]
            log.error("request %s: adapter %r failed to load: %s", seq.request_id, name, failed[seq.adapter])  # type: ignore[index]
            outputs.append(self._finish(seq, "error", now,
                                        f"adapter {name!r} could not be loaded: {failed[seq.adapter]}"))  # type: ignore[index]
        return outputs

    def blocked_on_loads(self) -> bool:
        """Nothing runs and waiting requests can only be waiting for background reads: the async
        engine may sleep until a read ends (the doorbell rings) or new work arrives."""
        if self.lora is None or self.scheduler.running:
            return False
        if any(q.wait_reason != "load" for q in self.scheduler.waiting):
            return False  # e.g. held back by a step that has just finished: the next step admits it
        reads, copies = self.lora.loads_in_flight()
        return reads > 0 and copies == 0

    def _fail_step(self, plan: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        return self._fail_seqs([s.seq for s in plan.prefills + plan.decodes], e)

    def _fail_seqs(self, seqs: list[Sequence], e: Exception) -> list[RequestOutput]:
        seqs = [q for q in seqs if q.status is not SeqStatus.FINISHED]  # e.g. ended while settling
        self.failed_steps += 1
        log.exception("engine step failed; failing its %d request(s): %s", len(seqs),
                      ", ".join(q.request_id for q in seqs))
        now = time.monotonic()
        message = f"the engine step running this request failed: {type(e).__name__}: {e}"
        return [self._finish(seq, "error", now, message) for seq in seqs]

    def _postprocess(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        sampling, drawn = self._sample(plan, logits)
        return self._append_tokens(sampling, *drawn)

    def _sample(self, plan: SchedulerOutput, logits: torch.Tensor,
                sampler: Callable = sample_full) -> tuple[list[Sequence], Any]:
        """Advance the plan's sequences and sample the ones that reach their last token: (those
        sequences, what `sampler` returns: sample_full's host tokens and logprobs, or a DeviceSample)."""
        sampling = self._advance(plan)
        return sampling, self._draw(sampling, logits, sampler)

    def _advance(self, plan: SchedulerOutput) -> list[Sequence]:
        """Count the step's prompt tokens and record its K/V as computed; the sequences that sample,
        in the order of their logits rows."""
        sampling = [s.seq for s in plan.prefills + plan.decodes if s.samples]
        for s in plan.prefills + plan.decodes:
            done, n_prompt = s.seq.num_computed_tokens, len(s.seq.prompt_token_ids)
            if done < n_prompt:
                self.stats.events.prompt_tokens_computed += min(done + s.num_new_tokens, n_prompt) - done
        self.scheduler.after_step(plan)
        return sampling

    def _draw(self, sampling: list[Sequence], logits: torch.Tensor, sampler: Callable) -> Any:
        """`sampler` over the rows of `sampling` with their bans, penalties and grammar masks. A row
        that finished since it was scheduled (async: on the step before) gets no mask: its token is
        dropped, and a matcher that took EOS can fill none."""
        banned = [self._banned(seq) for seq in sampling]
        history = [(seq.prompt_token_ids, seq.output_token_ids) if seq.params.penalized else ((), ())
                   for seq in sampling]
        matchers = [None if seq.status is SeqStatus.FINISHED else seq.matcher for seq in sampling]
        mask = None
        if any(m is not None for m in matchers):
            if self._masks is None:
                self._masks = MaskFiller(self.runner.args.vocab_size, self.config.max_num_seqs, self.runner.device)
            mask = self._masks.fill(matchers)
        return sampler(logits, [s.params for s in sampling], [s.generator for s in sampling], banned,
                       history, mask)

    def _append_tokens(self, sampling: list[Sequence], tokens: list[int],
                       logprobs: Optional[list[Optional[TokenLogprob]]]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for i, (seq, tok) in enumerate(zip(sampling, tokens)):
            out = self._append_token(seq, tok, now, None if logprobs is None else logprobs[i])
            if out is not None:
                outputs.append(out)
        return outputs

    def _banned(self, seq: Sequence) -> list[int]:
        p = seq.params
        if seq.matcher is not None:
            return []  # its grammar decides when EOS may come: banning it then would leave no token
        if len(seq.output_token_ids) + seq.num_pending < p.min_tokens:  # tokens sampled before this one
            return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.tokenizer.eos_token_ids))
        return []

    def _append_token(self, seq: Sequence, tok: int, now: float,
                      logprob: Optional[TokenLogprob] = None) -> Optional[RequestOutput]:
        p = seq.params
        ev = self.stats.events
        if seq.first_token_time is None:
            seq.first_token_time = now
            ev.ttfts.append((seq.adapter_name, now - seq.arrival_time))
            ev.prompt_tokens += len(seq.prompt_token_ids)
        else:
            ev.itls.append((seq.adapter_name, now - seq.last_token_time))  # type: ignore[operator]
        seq.last_token_time = now
        if seq.matcher is not None and not seq.matcher.accept_token(tok):
            # Only when the mask allowed nothing, which the compiler's check rules out at the start.
            return self._finish(seq, "error", now, f"token {tok} does not continue the request's grammar")
        if seq.matcher is not None and seq.matcher.is_terminated() and p.ignore_eos:
            seq.matcher.reset()  # ignore_eos (benchmarks): the row goes on with the grammar from the start
        seq.output_token_ids.append(tok)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        finish = None
        if (tok in p.stop_token_ids) or (not p.ignore_eos and tok in self.tokenizer.eos_token_ids):
            seq.output_token_ids.pop()  # stop tokens are not part of the completion
            del seq.output_logprobs[len(seq.output_token_ids):]
            finish = "stop"
        else:
            ev.generation_tokens += 1
            seq.text += seq.detok.add(tok)
            if len(seq.output_token_ids) >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
                finish = "length"
        if finish is not None:
            seq.text += seq.detok.flush()  # an unfinished character at the very end goes out as is
        if p.stop:
            cut = find_stop(seq.text, p.stop, seq.sent_chars)
            if cut is not None:
                seq.text = seq.text[:cut]
                finish = "stop"
        if finish is not None:
            return self._finish(seq, finish, now)
        # Hold back text that could still become a stop string.
        safe = len(seq.text) - partial_stop_len(seq.text, p.stop) if p.stop else len(seq.text)
        return self._emit(seq, safe, finished=False)

    def _emit(self, seq: Sequence, upto: int, finished: bool,
              error: Optional[str] = None) -> Optional[RequestOutput]:
        new_text = seq.text[seq.sent_chars:upto] if upto > seq.sent_chars else ""
        new_ids = seq.output_token_ids[seq.sent_tokens:]
        if not finished and not new_text and not new_ids:
            return None
        logprobs = None if seq.params.logprobs is None else seq.output_logprobs[seq.sent_tokens:]
        seq.sent_chars = max(seq.sent_chars, upto)
        seq.sent_tokens = len(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.request_id, token_ids=new_ids, text=new_text, finished=finished,
            finish_reason=seq.finish_reason, prompt_tokens=len(seq.prompt_token_ids),
            completion_tokens=len(seq.output_token_ids), error=error, logprobs=logprobs,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, finish_time=seq.finish_time,
            first_scheduled_time=seq.first_scheduled_time, load_wait_start=seq.load_wait_start,
            load_wait_end=seq.load_wait_end)

    def _finish(self, seq: Sequence, reason: str, now: float, error: Optional[str] = None) -> RequestOutput:
        seq.finish_reason = reason
        seq.finish_time = now
        self.scheduler.remove(seq)
        self._adapter_done(seq)
        self.seqs.pop(seq.request_id, None)
        self._record_finished(seq, reason, now)
        return self._emit(seq, len(seq.text), finished=True, error=error)  # type: ignore[return-value]

    def _record_finished(self, seq: Sequence, reason: str, now: float) -> None:
        self.stats.events.finished.append(FinishedRequest(seq.adapter_name, reason, now - seq.arrival_time))

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> EngineSnapshot:
        """The engine's state for the metrics' gauges; call on the engine thread (between steps)."""
        bm = self.block_manager
        lora = None
        if self.lora is not None:
            pool = self.lora.pool.stats()
            tiers = self.lora.tier_counts()
            reads, copies = self.lora.loads_in_flight()
            lora = LoRASnapshot(slots=pool.slots, slots_used=pool.used, slots_pinned=pool.pinned,
                                adapters_gpu=tiers["gpu"], adapters_cpu=tiers["cpu"],
                                adapters_registered=sum(tiers.values()), reads_in_flight=reads,
                                copies_in_flight=copies, adapters_disk=tiers["disk"],
                                adapters_remote=tiers["remote"], resident=self.lora.residency())
        running, waiting = self.scheduler.adapter_names()
        return EngineSnapshot(running=len(self.scheduler.running), waiting=self.scheduler.waiting_by_reason(),
                              kv_usage=bm.num_used / bm.num_blocks, lora=lora, running_adapters=running,
                              waiting_adapters=waiting, prefix_cache_blocks=bm.num_cached)
