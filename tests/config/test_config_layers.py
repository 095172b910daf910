"""The packaged default tree and an overrides dir layered over it (config/layers.py): a dir that holds
only what differs composes, keeps the packaged interpolations and defaults lists, refuses bad keys
naming them, and `appliance config show --diff` prints exactly the overrides."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import appliance
from appliance.config.compose import DEFAULT_CONFIG_DIR, compose_config, compose_tree
from appliance.config.schema import ConfigError
from tests.conftest import REPO


def overrides_dir(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_default_tree_is_package_data() -> None:
    # The wheel holds what pyproject's package-data globs match under the package dir: every file of
    # configs/, reached through appliance/default_configs, where compose looks by default.
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["appliance"]
    pkg = Path(appliance.__file__).parent
    shipped = {p.relative_to(pkg / "default_configs") for g in globs for p in pkg.glob(g)}
    assert shipped == {p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*.yaml")}
    assert DEFAULT_CONFIG_DIR == pkg.resolve() / "default_configs"
    assert compose_config(None).model.name == "SmolLM2-135M-Instruct"


def test_an_overrides_dir_changes_only_its_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_HOST", "10.1.2.3")
    d = overrides_dir(tmp_path, {
        "server/default.yaml": "port: 9000\n",
        "lora/default.yaml": "enabled: true\nmax_loras_per_batch: 6\n",
        "metrics/default.yaml": "gateway_compat: true\n",
        "adapters/team_a.yaml": "alpha:\n  path: /srv/adapters/alpha\n",
    })
    packaged = compose_config(None)
    c = compose_tree(d, ["adapters=[team_a]"])
    cfg = c.cfg
    assert cfg.server.port == 9000 and cfg.server.host == "10.1.2.3"  # the packaged interpolation kept
    assert cfg.lora.enabled and cfg.lora.max_loras_per_batch == 6
    assert cfg.lora.max_lora_rank == packaged.lora.max_lora_rank and cfg.metrics.gateway_compat
    assert list(cfg.adapters) == ["alpha"] and c.adapter_files == {"alpha": "adapters/team_a.yaml"}
    assert cfg.engine == packaged.engine and cfg.model == packaged.model
    # Without the selection the packaged model's own inventory selection ([demo]) still applies.
    assert sorted(compose_config(d).adapters) == sorted(compose_config(None, ["lora.enabled=true"]).adapters)


@pytest.mark.parametrize("files, needles", [
    ({"server/default.yaml": "prot: 9000\n"}, ["server.prot"]),
    ({"server/default.yaml": "port: nine\n"}, ["server.port"]),
    ({"server/default.yaml": "port: [unclosed\n"}, ["server/default.yaml"]),
])
def test_bad_overrides_name_the_key_or_file(tmp_path: Path, files: dict[str, str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        compose_config(overrides_dir(tmp_path, files))
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_a_missing_dir_is_still_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        compose_config(tmp_path / "nowhere")
    # A server that started on a complete tree keeps reading it as one: caught mid-copy without its
    # config.yaml, it fails to compose (nothing changes) rather than composing the packaged defaults.
    overrides_dir(tmp_path, {"server/default.yaml": "port: 9000\n"})
    assert compose_tree(tmp_path).cfg.server.port == 9000
    with pytest.raises(ConfigError, match="config file not found"):
        compose_tree(tmp_path, layered=False)


def test_config_show_diff_prints_the_overrides(tmp_path: Path) -> None:
    d = overrides_dir(tmp_path, {"server/default.yaml": "port: 9000\nadmin_key: hunter2\n",
                                 "metrics/default.yaml": "gateway_compat: true\n"})
    r = subprocess.run([sys.executable, "-m", "appliance", "config", "show", "--config-dir", str(d), "--diff",
                        "logging.format=json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        'logging.format: "json"  # default: "text"',
        "metrics.gateway_compat: true  # default: false",
        'server.admin_key: "***"  # default: "<from env APPLIANCE_ADMIN_KEY>"',
        'server.port: 9000  # default: "<from env APPLIANCE_PORT>"',
    ]
    assert "hunter2" not in r.stdout + r.stderr


def test_diff_of_a_mapping_filled_from_empty_names_only_its_keys() -> None:
    from appliance.config.layers import differences

    assert differences({"tracing": {"headers": {}}}, {"tracing": {"headers": {"auth": "x"}}}) == {
        "tracing.headers.auth": (None, "x")}
    assert differences({"t": {"h": {"a": 1}}}, {"t": {"h": {}}}) == {"t.h.a": (1, None)}
    assert differences({"t": {"h": {}}}, {"t": {"h": {}}}) == {}


def test_the_docs_configmap_example_composes(tmp_path: Path) -> None:
    import yaml

    section = (REPO / "docs/kubernetes.md").read_text()
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    configmap, pod = yaml.safe_load_all(block)
    for item in pod["volumes"][0]["configMap"]["items"]:  # what the kubelet writes into the mount
        (tmp_path / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / item["path"]).write_text(configmap["data"][item["key"]])
    args = pod["containers"][0]["args"]
    assert args[:3] == ["serve", "--config-dir", "/etc/appliance"]
    cfg = compose_config(tmp_path, args[3:])
    assert cfg.lora.enabled and cfg.lora.max_loras_per_batch == 8 and cfg.metrics.gateway_compat
    assert cfg.logging.format == "json" and list(cfg.adapters) == ["sql"]
    assert cfg.model == compose_config(None).model  # everything else: the packaged defaults
