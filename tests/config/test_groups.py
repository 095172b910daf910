"""The adapters multi-select group, the parallel and reconcile groups, and restart-only settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config.compose import compose_tree
from appliance.config.restart import restart_diff, restart_settings
from appliance.config.schema import ConfigError
from tests.conftest import REPO, default_config, shipped_config, unship


def tree(tmp_path: Path, files: dict[str, str], select: str = "[]", tail: str = "") -> Path:
    import shutil

    shutil.copytree(REPO / "configs", tmp_path, dirs_exist_ok=True)
    (tmp_path / "adapters").mkdir(exist_ok=True)
    for name, text in files.items():
        (tmp_path / "adapters" / f"{name}.yaml").write_text(text)
    unship(tmp_path, select)
    cfg = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(cfg + "lora:\n  enabled: true\n" + tail)
    return tmp_path


TEAM_A = "alpha:\n  path: /srv/a\n  pinned: true\nbeta:\n  path: /srv/b\n  rank: 8\n"
TEAM_B = "gamma:\n  path: /srv/g\n  target_modules: [q_proj, v_proj]\n"


def test_inventories_merge_and_remember_their_files(tmp_path: Path) -> None:
    c = compose_tree(tree(tmp_path, {"team_a": TEAM_A, "team_b": TEAM_B}), ["adapters=[team_a,team_b]"])
    assert sorted(c.cfg.adapters) == ["alpha", "beta", "gamma"]
    assert c.cfg.adapters["alpha"].pinned and c.cfg.adapters["beta"].rank == 8
    assert c.cfg.adapters["gamma"].target_modules == ["q_proj", "v_proj"]
    assert c.adapter_files == {"alpha": "adapters/team_a.yaml", "beta": "adapters/team_a.yaml",
                               "gamma": "adapters/team_b.yaml"}
    # Selected in the defaults list instead of on the command line: the same result.
    assert sorted(compose_tree(tree(tmp_path, {}, select="[team_a, team_b]")).cfg.adapters) == sorted(c.cfg.adapters)


def test_a_name_in_two_files_names_both(tmp_path: Path) -> None:
    d = tree(tmp_path, {"team_a": TEAM_A, "team_b": TEAM_B + "beta:\n  path: /srv/other\n"})
    with pytest.raises(ConfigError) as e:
        compose_tree(d, ["adapters=[team_a,team_b]"])
    assert "adapters.beta: defined in both adapters/team_a.yaml and adapters/team_b.yaml" in str(e.value)
    # The root file's own `adapters:` counts as a file too.
    d2 = tree(tmp_path / "2", {"team_a": TEAM_A}, tail="adapters:\n  alpha:\n    path: /srv/x\n")
    with pytest.raises(ConfigError, match="defined in both adapters/team_a.yaml and config.yaml"):
        compose_tree(d2, ["adapters=[team_a]"])


@pytest.mark.parametrize("text, needles", [
    ("alpha:\n  path: /a\n  colour: blue\n", ["adapters/team_a", "adapters.alpha.colour"]),
    ("alpha:\n  path: /a\n  pinned: maybe\n", ["adapters/team_a", "adapters.alpha.pinned"]),
    ("alpha:\n  path: /a\n  rank: 99\n", ["adapters/team_a.yaml", "adapters.alpha.rank"]),
    ("alpha: [unclosed\n", ["adapters/team_a.yaml", "line 1"]),
])
def test_bad_inventory_names_file_and_key(tmp_path: Path, text: str, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        compose_tree(tree(tmp_path, {"team_a": text}), ["adapters=[team_a]"])
    for n in needles:
        assert n in str(e.value)


def test_too_many_pins_is_refused(tmp_path: Path) -> None:
    pins = "".join(f"p{i}:\n  path: /a/{i}\n  pinned: true\n" for i in range(4))
    with pytest.raises(ConfigError, match="4 pinned .* at most lora.max_loras_per_batch - 1 = 3"):
        compose_tree(tree(tmp_path, {"many": pins}), ["adapters=[many]"])


def test_env_interpolation_in_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTER_ROOT", "/mnt/adapters")
    c = compose_tree(tree(tmp_path, {"env": "alpha:\n  path: ${oc.env:ADAPTER_ROOT}/alpha\n"}), ["adapters=[env]"])
    assert c.cfg.adapters["alpha"].path == "/mnt/adapters/alpha"


@pytest.mark.parametrize("override, key", [("parallel.tp_size=0", "parallel.tp_size"),
                                           ("parallel.backend=mpi", "parallel.backend"),
                                           ("parallel.nnodes=3", "parallel.nnodes"),
                                           ("parallel.node_rank=1", "parallel.node_rank"),
                                           ("reconcile.resync_s=-1", "reconcile.resync_s")])
def test_parallel_and_reconcile_checks(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        default_config(override)


def test_restart_settings_and_diff() -> None:
    a, b = default_config(), default_config("lora.max_lora_rank=32", "reconcile.prune=false",
                                            "server.admin_key=s3cr3t-value", "server.port=9000")
    sa, sb = restart_settings(a), restart_settings(b)
    assert "lora.max_lora_rank" in sa and "reconcile.prune" not in sa  # prune applies live
    assert "server.admin_key" not in sa and "server.port" not in sa  # secrets and address: in-process only
    assert not any(k.startswith("reconcile.") for k in sa)
    assert [c.key for c in restart_diff(sa, sb)] == ["lora.max_lora_rank"]
    local = restart_diff(restart_settings(a, in_process=True), restart_settings(b, in_process=True))
    assert [c.key for c in local] == ["lora.max_lora_rank", "server.admin_key", "server.port"]
    assert "s3cr3t" not in local[1].render()


def test_llama_8b_gpu_example_composes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_ADAPTER_ROOT", "/data/loras")
    cfg = shipped_config("model=llama-3.1-8b-instruct", "engine=gpu", "lora=gpu", "adapters=[llama_example]")
    assert cfg.model.dtype == "bfloat16" and cfg.model.source is None and cfg.lora.max_loras_per_batch == 32
    assert cfg.lora.adapter_roots == ["/data/loras"] and cfg.adapters["sql"].path == "/data/loras/sql-lora"
    assert cfg.adapters["sql"].pinned and cfg.adapters["support"].base_model == "meta-llama/Llama-3.1-8B-Instruct"
    # lora.backend auto: the kernels (and the decode CUDA graphs) on a GPU, plain torch elsewhere
    import torch

    from appliance.engine.runtime import lora_backend, sorted_decode

    assert cfg.lora.backend == "auto"
    assert lora_backend(cfg.lora, torch.device("cuda", 0)) == "triton"
    assert lora_backend(cfg.lora, torch.device("cpu")) == "torch"
    # and on CUDA the decode graphs sort rows by slot (csgmv's chunks), as backend csgmv does
    assert sorted_decode(cfg.lora, torch.device("cuda", 0)) and not sorted_decode(cfg.lora, torch.device("cpu"))
    pinned = shipped_config("model=llama-3.1-8b-instruct", "engine=gpu", "lora=gpu", "lora.backend=csgmv")
    assert lora_backend(pinned.lora, torch.device("cpu")) == "csgmv"  # refused later, at engine start
    assert sorted_decode(pinned.lora, torch.device("cuda", 0))
    explicit = shipped_config("model=llama-3.1-8b-instruct", "engine=gpu", "lora=gpu", "lora.backend=triton")
    assert not sorted_decode(explicit.lora, torch.device("cuda", 0))  # triton as given: one-token segments


def test_readme_gpu_command_composes_without_the_demo_adapters() -> None:
    """The README's GPU command: the demo adapters belong to the default model only, so the Llama
    model serves no inventory (theirs would sit outside lora=gpu's /srv/adapters root)."""
    assert sorted(shipped_config().adapters) == ["french", "pirate"]
    for model in ("llama-3.1-8b-instruct", "llama3-8b-shape"):
        cfg = shipped_config(f"model={model}", "engine=gpu", "lora=gpu")
        assert cfg.adapters == {} and cfg.lora.adapter_roots == ["/srv/adapters"]
    picked = shipped_config("model=llama-3.1-8b-instruct", "adapters=[demo,llama_example]")
    assert {"pirate", "sql"} <= set(picked.adapters)  # a command-line choice still wins


@pytest.mark.parametrize("value, mode", [("owned", "owned"), ("all", "all"), ("none", "none"),
                                         ("true", "all"), ("false", "none")])
def test_reconcile_prune_modes(value: str, mode: str) -> None:
    assert default_config(f"reconcile.prune={value}").reconcile.prune == mode
    assert default_config().reconcile.prune == "owned"


def test_reconcile_prune_rejects_other_values() -> None:
    with pytest.raises(ConfigError, match="reconcile.prune: must be one of owned, all, none"):
        default_config("reconcile.prune=some")


@pytest.mark.parametrize("yaml_name, needle", [
    ('"a\\nb"', "adapters['a\\nb']: invalid adapter name: must hold printable characters only, found U+000A"),
    ('"x\\e[31m"', "found U+001B"),
    ('"abc\\u202Edef"', "found U+202E"),
    ('"nul\\0"', "found U+0000"),
    ("n" * 129, "must be at most 128 characters, got 129"),
    ('"a:b"', "must not contain ':'"),
])
def test_inventory_names_follow_the_admin_rule(tmp_path: Path, yaml_name: str, needle: str) -> None:
    """The YAML inventory takes the names the admin API takes (lora/names.py), nothing else; the error
    names the file and the key, and is itself one short printable line."""
    with pytest.raises(ConfigError) as e:
        compose_tree(tree(tmp_path, {"team_a": f"{yaml_name}:\n  path: /srv/a\n"}), ["adapters=[team_a]"])
    msg = str(e.value)
    assert msg.startswith("adapters/team_a.yaml: adapters[") and needle in msg, msg
    assert msg.isprintable() and len(msg) < 300
