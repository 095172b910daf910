"""`appliance validate` over a config tree with adapters: one line per problem, exit codes 0/1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from appliance.config.validate import validate
from tests.conftest import config_tree
from tests.lora.test_lora_engine import make_adapter


def write_tree(dest: Path, tiny_model_dir: Path, root: Path, adapters_yaml: str) -> Path:
    return config_tree(dest, f"model:\n  path: {tiny_model_dir}\nlora:\n  enabled: true\n  max_lora_rank: 8\n"
                             f"  adapter_roots: [{root}]\nadapters:\n{adapters_yaml}")


def test_validate_lists_every_problem(tmp_path: Path, tiny_model_dir: Path) -> None:
    root = tmp_path / "adapters"
    make_adapter(tiny_model_dir, root / "qv", seed=0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    make_adapter(tiny_model_dir, root / "big", seed=1, r=16, lora_alpha=16, target_modules=["q_proj"])
    good = write_tree(tmp_path / "good", tiny_model_dir, root,
                      f"  qv:\n    path: {root / 'qv'}\n    rank: 4\n    target_modules: [v_proj, q_proj]\n")
    cfg, problems = validate(good, [])
    assert problems == [] and cfg is not None and list(cfg.adapters) == ["qv"]

    bad = write_tree(tmp_path / "bad", tiny_model_dir, root,
                     f"  qv:\n    path: {root / 'qv'}\n    rank: 8\n"
                     f"  big:\n    path: {root / 'big'}\n"
                     f"  gone:\n    path: {root / 'missing'}\n"
                     f"  escape:\n    path: {root}/../elsewhere\n")
    _, problems = validate(bad, [])
    assert len(problems) == 4, problems
    assert problems[0] == "config.yaml: adapters.qv.rank: expected 8, the adapter has rank 4"
    assert problems[1].startswith("config.yaml: adapters.big.path:") and "rank 16, above lora.max_lora_rank 8" in problems[1]
    assert problems[2].startswith("config.yaml: adapters.gone.path:") and "does not exist" in problems[2]
    assert problems[3].startswith("config.yaml: adapters.escape.path:") and "outside lora.adapter_roots" in problems[3]

    run = [sys.executable, "-m", "appliance", "validate", "--config-dir"]
    ok = subprocess.run(run + [str(good)], capture_output=True, text=True)
    assert ok.returncode == 0 and "1 adapter(s)" in ok.stdout
    no = subprocess.run(run + [str(bad)], capture_output=True, text=True)
    assert no.returncode == 1 and no.stderr.count("error: config.yaml: adapters.") == 4
    schema = subprocess.run(run + [str(good), "lora.max_lora_rank=zero"], capture_output=True, text=True)
    assert schema.returncode == 1 and "lora.max_lora_rank" in schema.stderr
