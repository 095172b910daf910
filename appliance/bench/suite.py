"""The benchmark's options and its phases in order. Offline phases share one engine (slots for the
largest count of distinct adapters a batch holds); the online phase gets an engine with the config's own
slots and CPU tier (that is the churn being measured); the transformers / peft baselines run last, after
the engines are freed. The JSON is rewritten after every phase, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import copy
import datetime
import gc
import platform
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch

from appliance.bench import baselines, report
from appliance.bench.adapters import adapter_name, make_adapters
from appliance.bench.options import OVERLAP_CHOICES, BenchOptions
from appliance.bench.schemas import load_schema
from appliance.bench.offline import copy_bandwidth, decode_step, prefill, run_requests, throughput_row
from appliance.bench.online import run_online
from appliance.bench.workload import poisson_arrivals, random_prompts, zipf_choices
from appliance.config.schema import ApplianceConfig
from appliance.engine.engine import LLMEngine
from appliance.engine.grammar.spec import GrammarSpec
from appliance.engine.runtime import lora_backend, resolve_device, resolve_dtype, sorted_decode
from appliance.models.llama import ModelArgs
from appliance.models.weights import read_hf_config


class Bench:
    def __init__(self, cfg: ApplianceConfig, opts: BenchOptions, command: str) -> None:
        opts.check()
        self.cfg, self.opts = cfg, opts
        self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.model_dir = Path(cfg.model.path).expanduser()
        self.hf_cfg = read_hf_config(self.model_dir)
        self.args = ModelArgs.from_hf_config(self.hf_cfg)
        self.out = Path(opts.out)
        self.t0 = time.monotonic()
        self.failed = False
        self.res: dict = {
            "meta": self._meta(command), "ceilings": {}, "offline": [], "decode_step": [], "prefill": [],
            "baselines": {"rows": []}, "online": {}, "startup": [], "targets": [], "plots": [], "errors": {},
            "skipped": {}}
        self.engine_one_tokens: list[list[int]] = []

    # ------------------------------------------------------------------ plumbing
    def _meta(self, command: str) -> dict:
        import transformers

        dev = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor() or "cpu"
        try:
            import peft

            peft_v = peft.__version__
        except ImportError:
            peft_v = None
        return {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": dev, "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft_v,
                "python": platform.python_version(), "model": self.cfg.model.name, "model_init": self.cfg.model.init,
                "dtype": str(self.dtype).removeprefix("torch."),
                "lora_backend": lora_backend(self.cfg.lora, self.device),
                "lora_sorted_decode": sorted_decode(self.cfg.lora, self.device), "options": asdict(self.opts)}

    def _phase(self, name: str, fn: Callable[[], None]) -> None:
        left = None if self.opts.budget_s is None else self.opts.budget_s - (time.monotonic() - self.t0)
        if left is not None and left <= 0:
            self.res["skipped"][name] = "time budget spent"
            print(f"[bench] {name}: skipped (time budget spent)", file=sys.stderr)
            return
        print(f"[bench] {name} ({time.monotonic() - self.t0:.0f} s in)", file=sys.stderr, flush=True)
        try:
            fn()
        except Exception as e:
            if not self.opts.keep_going:
                raise
            self.failed = True
            self.res["errors"][name] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        finally:
            self.res["targets"] = report.targets(self.res)
            report.write_json(self.res, self.out / "bench.json")

    def _left_s(self) -> Optional[float]:
        return None if self.opts.budget_s is None else self.opts.budget_s - (time.monotonic() - self.t0)

    def build_engine(self, label: str, slots: Optional[int], loaded: Optional[int], max_seqs: Optional[int],
                     overlap: Optional[bool] = None) -> LLMEngine:
        """An engine of the bench's config with LoRA on, its slots, CPU tier and max_num_seqs set where
        given, the synthetic adapters' root allowed (self.adapter_root: run() sets it; a script driving
        these helpers, e.g. benchmarks/prefill_ab_gpu.py, sets it first); its start-up cost recorded."""
        cfg = copy.deepcopy(self.cfg)
        if overlap is not None:
            cfg.lora.overlap_loading = overlap
        cfg.lora.enabled = True
        cfg.lora.max_lora_rank = max(self.opts.ranks)
        cfg.lora.adapter_roots = [*cfg.lora.adapter_roots, str(self.adapter_root)]
        if slots is not None:
            cfg.lora.max_loras_per_batch = slots
        if loaded is not None:
            cfg.lora.max_loaded_loras = max(loaded, cfg.lora.max_loras_per_batch)
        if max_seqs is not None:
            cfg.engine.max_num_seqs = max_seqs
        cfg.check()
        t0 = time.perf_counter()
        eng = LLMEngine(cfg)
        # Start-up cost: model, KV cache, graph capture and the kernel warm-up (engine.warmup).
        w = eng.warmup
        self.res["startup"].append({
            "engine": label, "build_s": round(time.perf_counter() - t0, 2),
            "warmup_steps": w.steps if w else 0, "warmup_s": round(w.seconds, 2) if w else None,
            "warmup_compiled": w.compiled if w else None,
            "graph_sizes": eng.runner.static_decode.sizes if eng.runner.static_decode else [],
            "piecewise_sizes": eng.runner.piecewise.sizes if eng.runner.piecewise else []})
        return eng

    def synthetic_adapters(self, rank: int, count: int) -> dict[str, Path]:
        """`count` random PEFT adapters of `rank` for the model's shapes under self.adapter_root (reused)."""
        return make_adapters(self.adapter_root, self.args, rank, count, self.opts.targets,
                             float(self.hf_cfg.get("initializer_range", 0.02)),
                             torch.float32 if self.dtype == torch.float32 else torch.bfloat16,
                             self.device, self.cfg.model.name, self.opts.progress)

    def load_adapters(self, engine: LLMEngine, names: dict[str, Path]) -> None:
        """Load every adapter of `names` into the engine's registry (the admin path's load)."""
        from tqdm import tqdm

        assert engine.lora is not None
        for name, path in tqdm(names.items(), desc="loading adapters", disable=not self.opts.progress, leave=False):
            engine.lora.load(name, str(path))

    def _free(self) -> None:
        """Give back device memory of engines/models the caller has already dropped."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ phases
    def run(self) -> dict:
        o = self.opts
        tmp = o.adapter_dir is None
        self.adapter_root = Path(tempfile.mkdtemp(prefix="appliance-bench-")) if tmp else Path(o.adapter_dir)
        self.adapter_root.mkdir(parents=True, exist_ok=True)
        try:
            self._phase("ceilings", self._ceilings)
            if o.mode in ("offline", "all"):
                self._offline()
            # The baselines right after the offline engine is freed (they compare with its rows), before
            # the online engines: with --budget-s, a long online phase cannot crowd them out.
            if o.mode in ("offline", "all") and not o.skip_baselines:
                self._phase("baselines", self._baselines)
            if o.mode in ("online", "all"):
                self._phase("online", self._online)
        finally:
            if tmp:
                shutil.rmtree(self.adapter_root, ignore_errors=True)
        self.res["plots"] = report.plots(self.res, self.out)
        report.write_json(self.res, self.out / "bench.json")
        return self.res

    def _ceilings(self) -> None:
        nbytes = 2 << 30 if self.device.type == "cuda" else 64 << 20
        self.res["ceilings"]["copy_gb_s"] = round(copy_bandwidth(self.device, nbytes) / 1e9, 1)

    def _offline(self) -> None:
        o = self.opts
        r0 = o.main_rank
        counts = {r: max(o.adapters, default=0) for r in o.ranks}
        counts[r0] = max(counts[r0], o.decode_adapters if o.decode_steps else 0,
                         o.prefill_adapters if o.prefill_requests else 0, o.baseline_adapters)
        slots = max([min(d, o.batch) for d in o.adapters] + [min(o.decode_adapters, o.decode_batch),
                     min(o.prefill_adapters, max(o.prefill_requests, 1)),
                     min(o.baseline_adapters, o.baseline_batch), 1])
        names: dict[int, list[str]] = {}
        holder: dict[str, LLMEngine] = {}

        def setup() -> None:
            dirs: dict[str, Path] = {}
            for r, n in counts.items():
                got = self.synthetic_adapters(r, n)
                names[r] = list(got)
                dirs.update(got)
            eng = self.build_engine("offline", slots, len(dirs),
                                    max(o.batch, o.decode_batch, o.prefill_requests, o.baseline_batch))
            self.load_adapters(eng, dirs)
            holder["engine"] = eng
            # Warm-up, not timed: first-step allocations at full batch, kernel compilation, slot loads.
            warm = random_prompts(o.batch, o.prompt_len, self.args.vocab_size, o.seed + 99)
            run_requests(eng, warm, [None] * len(warm), 2)
            if names[r0]:
                run_requests(eng, warm, [names[r0][i % len(names[r0])] for i in range(len(warm))], 2)

        self._phase("offline setup", setup)
        eng = holder.get("engine")
        if eng is None:
            return
        vocab = self.args.vocab_size

        def sweep() -> None:
            for r in o.ranks:
                for d in o.adapters:
                    if d == 0 and r != o.ranks[0]:
                        continue  # the base row once
                    n = max(o.batch, d)
                    prompts = random_prompts(n, o.prompt_len, vocab, o.seed + 1)
                    keys = [None] * n if d == 0 else [names[r][i % d] for i in range(n)]
                    # Same layout, 2 tokens, not timed: the LoRA kernels compile per batch layout, and a
                    # first compile inside a timed run would be timed with it.
                    run_requests(eng, prompts, keys, 2)
                    run = run_requests(eng, prompts, keys, o.new_tokens, desc=f"offline r{r} D{d}",
                                       progress=o.progress)
                    self.res["offline"].append(throughput_row(run, rank=r if d else 0, adapters=d, requests=n,
                                                              batch=min(n, o.batch), prompt_len=o.prompt_len,
                                                              new_tokens=o.new_tokens))
                    report.write_json(self.res, self.out / "bench.json")

        self._phase("offline", sweep)

        def decode() -> None:
            prompts = random_prompts(o.decode_batch, o.decode_context, vocab, o.seed + 2)
            variants: list[tuple[str, dict]] = [("plain", {})]
            if o.decode_logprobs is not None:
                variants.append((f"logprobs{o.decode_logprobs}", {"logprobs": o.decode_logprobs}))
            if o.decode_json_schema is not None:
                variants.append(("json_schema", {"grammar": GrammarSpec.json_schema(load_schema(o.decode_json_schema))}))
            for d in (0, o.decode_adapters):
                keys = [None if d == 0 else names[r0][i % d] for i in range(o.decode_batch)]
                plain: Optional[dict] = None
                for variant, sampling in variants:
                    row = decode_step(eng, prompts, keys, o.decode_steps, self.res["ceilings"]["copy_gb_s"] * 1e9,
                                      r0, o.targets, progress=o.progress, profile=o.profile_decode, variant=variant,
                                      sampling=sampling)
                    if plain is None:
                        plain = row
                    else:  # the targets: this step over the plain one
                        row["x_unconstrained"] = round(row["step_ms"] / plain["step_ms"], 3)
                    if variant == "json_schema":
                        row["json_schema"] = o.decode_json_schema
                    self.res["decode_step"].append(row)

        if o.decode_steps > 0:
            self._phase("decode_step", decode)

        def prefill_phase() -> None:
            prompts = random_prompts(o.prefill_requests, o.prefill_len, vocab, o.seed + 3)
            d = o.prefill_adapters
            for label, keys in (("base", [None] * len(prompts)),
                                (f"{d} distinct rank-{r0}", [names[r0][i % d] for i in range(len(prompts))])):
                prefill(eng, prompts, keys, label)  # warm-up of this layout, not kept
                self.res["prefill"].append(prefill(eng, prompts, keys, label, o.progress))

        if o.prefill_requests > 0 and o.prefill_adapters > 0:
            self._phase("prefill", prefill_phase)

        def engine_side() -> None:
            n, d = o.baseline_batch, o.baseline_adapters
            nt = o.baseline_tokens
            prompts = random_prompts(n, o.prompt_len, vocab, o.seed + 4)
            layouts = ((0, [None] * n), (1, [names[r0][0]] * n), (d, [names[r0][i % d] for i in range(n)]))
            for label_d, keys in layouts:
                run_requests(eng, prompts, keys, 2)  # warm-up of this layout
                run = run_requests(eng, prompts, keys, nt, desc=f"appliance D{label_d}", progress=o.progress)
                if label_d == 1:
                    self.engine_one_tokens = run.tokens
                row = throughput_row(run, impl="appliance", adapters=label_d, batch=n, new_tokens=nt)
                self.res["baselines"]["rows"].append(row)
            if o.hf_tokens != nt:  # the workload transformers / peft run: the direct same-run ratio
                for label_d, keys in layouts:
                    run = run_requests(eng, prompts, keys, o.hf_tokens)
                    self.res["baselines"]["rows"].append(throughput_row(
                        run, impl="appliance", adapters=label_d, batch=n, new_tokens=o.hf_tokens))

        if o.baseline_batch > 0:
            self._phase("baselines (engine side)", engine_side)
        holder.clear()
        eng.close()  # its other tensor-parallel ranks, if any (the next engine makes its own)
        eng = None  # the last reference: free the engine before the baselines load their models
        self._free()

    def _online(self) -> None:
        """The churn workload once per --online-overlap setting, each on a fresh engine (same adapters,
        prompts, arrivals); `online` is the last run, `online_runs` all of them."""
        o = self.opts
        r0 = o.main_rank
        dirs = self.synthetic_adapters(r0, o.online_adapters)
        pop = zipf_choices(o.online_requests, o.online_adapters, o.zipf, o.seed + 5)
        keys = [adapter_name(r0, k) for k in pop]
        prompts = random_prompts(o.online_requests, o.prompt_len, self.args.vocab_size, o.seed + 6)
        arrivals = poisson_arrivals(o.online_requests, o.online_rate, o.seed + 7)
        runs: list[dict] = []
        self.res["online_runs"] = runs
        head = adapter_name(r0, 0)  # the Zipf head: the single-adapter comparison's adapter
        for i, overlap in enumerate(OVERLAP_CHOICES[o.online_overlap]):
            left = self._left_s()
            if i > 0 and left is not None and left <= 0:
                self.res["skipped"][f"online run {i + 1}"] = "time budget spent"
                print(f"[bench] online run {i + 1}: skipped (time budget spent)", file=sys.stderr)
                break
            eng = self.build_engine(f"online {i + 1}", None, None, None, overlap)
            try:
                # Loading all of them leaves the last lora.max_loaded_loras in the CPU tier: the most
                # popular ones (Zipf item 0 first) are on disk only, so the run starts with cold reads.
                self.load_adapters(eng, dirs)
                single = head if o.online_single == "each" or (o.online_single == "first" and i == 0) else None
                res = run_online(eng, prompts, keys, arrivals, o.new_tokens, o.progress, single=single)
                assert eng.lora is not None
                res.update(run=i + 1, adapters=o.online_adapters, zipf_s=o.zipf, offered_rate_rps=o.online_rate,
                           rank=r0, slots=eng.cfg.lora.max_loras_per_batch, cpu_tier=eng.cfg.lora.max_loaded_loras,
                           prompt_len=o.prompt_len, new_tokens=o.new_tokens)
                runs.append(res)
                self.res["online"] = res
                report.write_json(self.res, self.out / "bench.json")
            finally:
                eng.close()
                del eng
                self._free()

    def _baselines(self) -> None:
        o = self.opts
        why = baselines.available()
        if why is not None:
            self.res["baselines"]["skipped"] = why
            print(f"[bench] {why}", file=sys.stderr)
            return
        prompts = random_prompts(o.baseline_batch, o.prompt_len, self.args.vocab_size, o.seed + 4)
        dirs = list(self.synthetic_adapters(o.main_rank, o.baseline_adapters).values())
        rows, one = baselines.run_baselines(self.cfg, self.dtype, self.device, prompts, o.hf_tokens, dirs,
                                            o.baseline_tokens)
        self.res["baselines"]["rows"] += rows
        if self.engine_one_tokens:
            k = min(len(one[0]), len(self.engine_one_tokens[0]))  # peft may have run fewer tokens
            same = sum(a[:k] == b[:k] for a, b in zip(one, self.engine_one_tokens))
            self.res["baselines"]["greedy_match"] = f"{same}/{len(one)}"
            self.res["baselines"]["greedy_match_tokens"] = k
        self._free()


def run_bench(cfg: ApplianceConfig, opts: BenchOptions, command: str) -> int:
    bench = Bench(cfg, opts, command)
    res = bench.run()
    print(report.render(res))
    for p in res["plots"]:
        print(p)
    print(f"JSON: {bench.out / 'bench.json'}")
    return 1 if bench.failed else 0
