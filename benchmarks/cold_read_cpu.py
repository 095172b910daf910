"""How long a cold adapter read takes, and how long it keeps the GIL from other threads (CPU, no GPU).

Not a test: it prints a table. One synthetic 8B-shape adapter (Llama-3.1-8B's shapes, all 7 projections,
bf16) is written once to a temp dir, then read --repeats times through the real cold-read path
(`load_adapter_weights`: confined read, header check, checksum, parse, finite checks, scale), as the
overlap-loading reader thread does, while a heartbeat thread sleeps 1 ms at a time and records the
longest gap between its wake-ups: the longest stretch the read kept the GIL (the engine thread's
stall). Idle gives the heartbeat's own floor on this machine.

    .venv/bin/python benchmarks/cold_read_cpu.py [--rank 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from appliance.bench.adapters import write_adapter
from appliance.config.schema import LORA_TARGETS, LoRAConfig
from appliance.lora.adapter import inspect_adapter, load_adapter_weights
from appliance.models.args import ModelArgs
from appliance.models.weights import read_hf_config

SHAPE_DIR = Path(__file__).resolve().parents[1] / "appliance" / "models" / "shapes" / "llama-3.1-8b"


class Heartbeat:
    """A thread that sleeps 1 ms in a loop; `max_gap_ms` is its longest time between two wake-ups."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()

    args = ModelArgs.from_hf_config(read_hf_config(SHAPE_DIR))
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
