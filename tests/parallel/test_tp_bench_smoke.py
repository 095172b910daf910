"""benchmarks/bench_tp_gpu.py --smoke: the GPU script's whole path on CPU ranks with gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_bench_tp_gpu_smoke_runs_parity_and_decode_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_tp_gpu.py"), "--smoke", "--out", str(out)],
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    (p,) = res["parity"]
    assert p["identical"] == p["sequences"] == 6 and p["tokens_tp1"] == p["tokens_tp2"]
    assert all(len(t) == 8 for t in p["tokens_tp1"])
    rows = {(d["tp"], d["batch"]) for d in res["decode"]}
    assert rows == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(d["step_ms"] > 0 and d["adapters"] >= 1 and not d["graphs"] for d in res["decode"])
    assert all(d["bcast_ms"] > 0 for d in res["decode"] if d["tp"] == 2)
    assert "| cpu tp=2 | 4 |" in r.stdout
