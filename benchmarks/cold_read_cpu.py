"""How long a cold adapter read takes, and how long it keeps the GIL from other threads (CPU, no GPU).

Not a test: it prints a table. One synthetic 8B-shape adapter (Llama-3.1-8B's shapes, all 7 projections,
bf16) is written once to a temp dir, then read --repeats times through the real cold-read path
(`load_adapter_weights`: confined read, header check, checksum, parse, finite checks, scale), as the
overlap-loading reader thread does, while a heartbeat thread sleeps 1 ms at a time and records the
longest gap between its wake-ups: the longest stretch the read kept the GIL (the engine thread's
stall). Idle gives the heartbeat's own floor on this machine.

`--load` times a whole cold load instead, stage by stage, as the server runs it beside the engine
thread, and the longest "step" of a probe thread beside it that drops and retakes the GIL 20 times
every ms (StepProbe: the engine thread's pattern, which a single heartbeat wake-up does not show;
`--probe heartbeat` runs the heartbeat instead). Stages: the fetch from a local S3 API server (moto's,
a process of its own) into the disk cache, in this process (lora.fetch_in_subprocess=false) or in a
worker process (true); the read; the slot fill's host work (the copy thread's pack into a staging
buffer, lora/staging.py, then the copy into one slot of every wrapper; on CPU that copy is a memcpy).

    .venv/bin/python benchmarks/cold_read_cpu.py [--rank 16] [--repeats 5] [--load [--probe heartbeat]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from appliance.bench.adapters import proj_shape, write_adapter
from appliance.config.schema import LORA_TARGETS, LoRAConfig
from appliance.lora.adapter import inspect_adapter, load_adapter_weights
from appliance.lora.layers import FUSED_SLICES, LoRAContext, LoRALinear
from appliance.lora.staging import SlotImage
from appliance.models.args import ModelArgs
from appliance.models.weights import read_hf_config

SHAPE_DIR = Path(__file__).resolve().parents[1] / "appliance" / "models" / "shapes" / "llama-3.1-8b"


class Heartbeat:
    """A thread that sleeps 1 ms in a loop; `max_gap_ms` is its longest time between two wake-ups."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.ends: list[float] = []  # when each gap ended (perf_counter)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            self.ends.append(now)
            last = now

    def between(self, t0: float, t1: float) -> list[float]:
        """The gaps that ended within [t0, t1]."""
        return [g for g, e in zip(self.gaps, self.ends) if t0 <= e <= t1]

    def __enter__(self) -> "Heartbeat":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    @property
    def max_gap_ms(self) -> float:
        return 1e3 * max(self.gaps, default=0.0)

    def over_ms(self, ms: float) -> int:
        return sum(g * 1e3 > ms for g in self.gaps)


class StepProbe(Heartbeat):
    """An engine step's GIL pattern: every ms, HANDOFFS calls that drop and retake the GIL (as each torch
    call of a step does); `gaps` holds how long each such burst took. Alone it takes microseconds;
    beside a thread running Python, each retake may wait out the GIL switch interval (5 ms)."""

    HANDOFFS = 20

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(0.001)
            t0 = time.perf_counter()
            for _ in range(self.HANDOFFS):
                time.sleep(0)  # releases the GIL and asks for it back
            now = time.perf_counter()
            self.gaps.append(now - t0)
            self.ends.append(now)


class _Shape(nn.Module):
    """A projection's shape and dtype, no weights: what LoRALinear reads of its base to size its slots."""

    def __init__(self, in_f: int, out_f: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_f, out_f
        self.weight = torch.empty(0, dtype=torch.bfloat16)


def one_slot(args: ModelArgs, rank: int) -> LoRAContext:
    """The 8B shape's LoRA wrappers (all projections) with one slot each, on CPU."""
    ctx = LoRAContext(backend="torch")
    for i in range(args.num_layers):
        for path, names in FUSED_SLICES.items():
            sizes = [proj_shape(n, args)[1] for n in names]
            base = _Shape(proj_shape(names[0], args)[0], sum(sizes))
            ctx.wrappers[f"layers.{i}.{path}"] = LoRALinear(base, names, sizes, 1, rank, ctx)  # type: ignore[arg-type]
    return ctx


def whole_loads(a: argparse.Namespace, args: ModelArgs, tmp: Path) -> None:
    from appliance.bench.serve_cold import MOTO_BUCKET, MOTO_REGION, ColdStore
    from appliance.lora.sources.fetch import AdapterSources
    from appliance.lora.sources.worker import FetchWorkers

    store = ColdStore.moto(tmp / "moto.log")
    os.environ.update(store.server_env)  # the run's one-off moto credentials, for boto3 here and in the workers
    try:
        src_dir = write_adapter(tmp / "src", args, a.rank, LORA_TARGETS, seed=0, std=0.02, dtype=torch.bfloat16,
                                device=torch.device("cpu"))
        mib = (src_dir / "adapter_model.safetensors").stat().st_size / 2**20
        names = [f"{mode}-{i}" for mode in ("inproc", "worker") for i in range(a.repeats + 1)]
        for n in names:
            store.upload(n, src_dir)
        ctx = one_slot(args, a.rank)
        image = SlotImage(ctx)
        buf = torch.empty(image.numel, dtype=image.dtype)  # the staging buffer (page-locked on CUDA)
        print(f"whole cold loads of one rank-{a.rank} 8B-shape adapter ({mib:.1f} MiB bf16) from moto, "
              f"torch threads {torch.get_num_threads()}")
        probe = StepProbe if a.probe == "step" else Heartbeat
        over = 20.0 if a.probe == "step" else 5.0  # ms: what counts as a long step / gap
        what = "step" if a.probe == "step" else "heartbeat gap"
        print(f"{'fetch in':<9} {'stage':<7} {'ms (median)':>12} {f'longest {what} ms (median / worst)':>32} "
              f"{f'> {over:.0f} ms':>12}")
        with probe() as sp:
            time.sleep(1.0)
        print(f"{'-':<9} {'idle 1 s':<7} {'':>12} {sp.max_gap_ms:>20.1f} / {sp.max_gap_ms:>9.1f} "
              f"{sp.over_ms(over):>12}")
        modes = ("inproc", "worker")
        runs = {}
        for mode in modes:
            cfg = LoRAConfig(adapter_roots=[], allowed_sources=[f"s3://{MOTO_BUCKET}"], max_lora_rank=a.rank,
                             adapter_cache_dir=str(tmp / f"cache-{mode}"), s3_endpoint_url=store.endpoint_url,
                             s3_region=MOTO_REGION, fetch_in_subprocess=mode == "worker")
            runs[mode] = (cfg, AdapterSources(cfg, FetchWorkers(cfg, 1, 600) if mode == "worker" else None))
        stages = {m: {"fetch": [], "read": [], "fill": [], "whole": []} for m in modes}
        for i in range(a.repeats + 1):  # the first warms boto3 (and starts the worker): not counted
            for mode in modes:  # alternated: both see the same noise of a shared machine
                cfg, sources = runs[mode]
                uri = store.template.replace("{name}", f"{mode}-{i}")
                marks: list[float] = []
                with probe() as sp:
                    time.sleep(0.01)
                    marks.append(time.perf_counter())
                    fetched = sources.fetch(uri)
                    marks.append(time.perf_counter())
                    assert fetched is not None
                    spec = inspect_adapter(fetched.dir, cfg, args)
                    weights = load_adapter_weights(spec, torch.bfloat16, cfg, args)
                    marks.append(time.perf_counter())
                    image.pack(buf, weights)
                    image.unpack(0, buf)
                    marks.append(time.perf_counter())
                    time.sleep(0.01)
                if i == 0:
                    continue
                for stage, t0, t1 in (("fetch", marks[0], marks[1]), ("read", marks[1], marks[2]),
                                      ("fill", marks[2], marks[3]), ("whole", marks[0], marks[3])):
                    steps = sp.between(t0, t1)
                    stages[mode][stage].append((t1 - t0, max(steps, default=0.0), sum(g > over / 1e3 for g in steps)))
        for mode in modes:
            runs[mode][1].close()
            for stage, rows in stages[mode].items():
                print(f"{'process' if mode == 'worker' else 'server':<9} {stage:<7} "
                      f"{1e3 * statistics.median(r[0] for r in rows):>12.1f} "
                      f"{1e3 * statistics.median(r[1] for r in rows):>20.1f} / {1e3 * max(r[1] for r in rows):>9.1f} "
                      f"{int(statistics.median(r[2] for r in rows)):>12}")
    finally:
        store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--load", action="store_true", help="whole cold loads from moto: fetch, read, slot fill")
    p.add_argument("--probe", choices=("step", "heartbeat"), default="step",
                   help="--load: beside it a StepProbe (20 GIL handoffs a ms) or the plain heartbeat")
    a = p.parse_args()

    args = ModelArgs.from_hf_config(read_hf_config(SHAPE_DIR))
    if a.load:
        with tempfile.TemporaryDirectory() as tmp:
            whole_loads(a, args, Path(tmp))
        return
    cfg = LoRAConfig(adapter_roots=["/"], max_lora_rank=max(16, a.rank))
    with tempfile.TemporaryDirectory() as tmp:
        d = write_adapter(Path(tmp) / "a", args, a.rank, LORA_TARGETS, seed=0, std=0.02,
                          dtype=torch.bfloat16, device=torch.device("cpu"))
        mib = (d / "adapter_model.safetensors").stat().st_size / 2**20
        spec = inspect_adapter(d, cfg, args)
        load_adapter_weights(spec, torch.bfloat16, cfg, args)  # warm the page cache and torch

        rows = []
        with Heartbeat() as hb:
            time.sleep(0.5)
        rows.append(("idle 0.5 s", 0.0, hb.max_gap_ms, hb.over_ms(5)))
        walls, gaps, over = [], [], []
        for _ in range(a.repeats):
            with Heartbeat() as hb:
                time.sleep(0.01)
                t0 = time.perf_counter()
                load_adapter_weights(replace(spec), torch.bfloat16, cfg, args)
                walls.append(time.perf_counter() - t0)
                time.sleep(0.01)
            gaps.append(hb.max_gap_ms)
            over.append(hb.over_ms(5))
        rows.append((f"read x{a.repeats} (median)", 1e3 * statistics.median(walls), statistics.median(gaps),
                     int(statistics.median(over))))
        rows.append((f"read x{a.repeats} (worst)", 1e3 * max(walls), max(gaps), max(over)))

    print(f"cold read of one rank-{a.rank} 8B-shape adapter ({mib:.1f} MiB bf16, 7 projections x "
          f"{args.num_layers} layers), torch threads {torch.get_num_threads()}")
    print(f"{'run':<22} {'read ms':>9} {'longest heartbeat gap ms':>25} {'gaps > 5 ms':>12}")
    for name, wall, gap, n in rows:
        print(f"{name:<22} {wall:>9.1f} {gap:>25.1f} {n:>12}")


if __name__ == "__main__":
    main()
