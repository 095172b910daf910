"""Print the decode-step rows of two or more `appliance bench` JSON files side by side (e.g. one run
with engine.fused_kernels=torch, one with triton): step ms, floor, x floor, and with --profile-decode
the kernels per step, their device time and the top kernels. "step ms" is the median over blocks of
steps back to back (each block's mean step listed after), "serial" the median of steps each read and
synchronised before the next (no async overlap).

    python benchmarks/decode_compare.py LABEL=DIR/bench.json LABEL=DIR/bench.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    runs = []
    for arg in sys.argv[1:]:
        label, _, path = arg.partition("=")
        p = Path(path)
        if not p.is_file():
            print(f"{label}: {p} missing")
            continue
        runs.append((label, json.loads(p.read_text())))
    print(f"{'run':>8} {'adapters':>8} {'step ms':>8} {'serial':>8} {'floor':>7} {'x floor':>7} {'kernels':>8} "
          f"{'kernel us':>9}  blocks (compiled while timing)")
    for label, res in runs:
        for r in res.get("decode_step", []):
            print(f"{label:>8} {r['adapters']:>8} {r['step_ms']:>8} {r.get('step_ms_serial', '-'):>8} {r['floor_ms']:>7} "
                  f"{r['x_floor']:>7} "
                  f"{r.get('kernels_per_step', '-'):>8} {r.get('kernel_us_per_step', '-'):>9}  "
                  f"{' / '.join(map(str, r.get('step_ms_blocks', [])))} ({r.get('compiled_during', '-')})")
        if res.get("errors"):
            print(f"{label} errors: {res['errors']}")
    for label, res in runs:
        for r in res.get("decode_step", []):
            print(f"\n{label}, {r['adapters']} adapters, top kernels (us/step, calls/step):")
            for k in r.get("top_kernels", []):
                print(f"  {k['us_per_step']:>8} {k['calls_per_step']:>6}  {k['name']}")


if __name__ == "__main__":
    main()
