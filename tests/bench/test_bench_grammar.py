"""`appliance bench offline --decode-json-schema`: each decode row runs again with the schema on every
sequence, and the report gives its step time against the unconstrained one (the issue's <= 1.10x)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.cli import main


def test_decode_rows_with_a_json_schema_on_every_sequence(tmp_path: Path, tiny_model_dir: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    rc = main(["bench", "offline", "--out", str(out), "--no-progress", "--batch", "2", "--prompt-len", "8",
               "--new-tokens", "2", "--adapters", "0", "--ranks", "8", "--decode-batch", "4",
               "--decode-context", "16", "--decode-steps", "3", "--decode-adapters", "2",
               "--decode-json-schema", "record", "--prefill-requests", "0", "--skip-baselines",
               "--baseline-batch", "1", "--baseline-adapters", "1",
               f"model.path={tiny_model_dir}", "model.name=tiny", "model.device=cpu", "model.max_model_len=256",
               "lora.max_loras_per_batch=2", "engine.grammar_threads=1"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    res = json.loads((out / "bench.json").read_text())
    assert res["errors"] == {}
    rows = res["decode_step"]
    assert [(r["adapters"], r.get("json_schema")) for r in rows] == [(0, None), (0, "record"), (2, None), (2, "record")]
    for free, constrained in ((rows[0], rows[1]), (rows[2], rows[3])):
        assert constrained["x_unconstrained"] == round(constrained["step_ms"] / free["step_ms"], 3)
        assert constrained["async_scheduling"] is free["async_scheduling"]  # constrained steps keep it
    targets = [t["target"] for t in res["targets"]]
    assert sum(t.startswith("decode step with JSON schema 'record' on every row / unconstrained") for t in targets) == 2
    assert "| record |" in printed


def test_bad_schema_option_is_refused(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "offline", "--decode-json-schema", "no-such-schema"]) == 1
    assert "--decode-json-schema" in capsys.readouterr().err
