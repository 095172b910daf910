"""PEFT adapter dirs made by peft itself: what inspect_adapter reports, what it refuses, and that the loaded
A / scale-folded B reproduce peft's own LoRA delta, scale·lora_B(lora_A(x)), module by module."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from appliance.config.schema import LORA_TARGETS, LoRAConfig
from appliance.lora.adapter import (
    AdapterError,
    AdapterSpec,
    inspect_adapter,
    load_adapter_weights,
    resolve_adapter_path,
)
from appliance.models.llama import ModelArgs
from appliance.models.weights import read_hf_config

QV = ["q_proj", "v_proj"]


def lcfg(**kw: Any) -> LoRAConfig:
    """LoRA settings whose adapter_roots admit every path: these tests are about the files, not the roots."""
    return LoRAConfig(adapter_roots=["/"], **kw)


def make_adapter(base_dir: Path, dest: Path, safe: bool = True, **kw: Any) -> PeftModel:
    """Save a peft LoRA with random (non-zero) A and B for the model in base_dir; return the PeftModel."""
    torch.manual_seed(len(str(dest)))
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw))
    model.save_pretrained(dest, safe_serialization=safe)
    return model


def peft_layers(model: PeftModel) -> dict[str, LoraLayer]:
    """`layers.{i}.{proj}` -> peft's LoRA layer."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            parts = name.split(".")
            i = parts.index("layers")
            out[f"layers.{parts[i + 1]}.{parts[-1]}"] = mod
    return out


def edit_config(d: Path, **changes: Any) -> None:
    p = d / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def args(tiny_model_dir: Path) -> ModelArgs:
    return ModelArgs.from_hf_config(read_hf_config(tiny_model_dir))


@pytest.fixture(scope="module")
def qv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PeftModel]:
    """r=8, alpha=16 on q/v: the adapter the refusal tests copy and damage."""
    d = tmp_path_factory.mktemp("lora") / "qv8"
    return d, make_adapter(tiny_model_dir, d, r=8, lora_alpha=16, target_modules=QV)


@pytest.fixture
def qv_copy(qv: tuple[Path, PeftModel], tmp_path: Path) -> Path:
    return Path(shutil.copytree(qv[0], tmp_path / "copy"))


CASES = {
    "r4_qv": dict(r=4, lora_alpha=8, target_modules=QV),
    "r8_rslora_all_linear": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                     rank_pattern={"layers.1.self_attn.q_proj": 8, "down_proj": 2},
                     alpha_pattern={"v_proj": 3, r"model\.layers\.0\.self_attn\.o_proj": 32}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_spec_and_weights_match_peft(case: str, tiny_model_dir: Path, args: ModelArgs, tmp_path: Path) -> None:
    kw = CASES[case]
    model = make_adapter(tiny_model_dir, tmp_path / case, **kw)
    spec = inspect_adapter(tmp_path / case, lcfg(max_lora_rank=16), args)
    layers = peft_layers(model)

    # peft's own reading of r / alpha / rslora / patterns is the oracle, module by module.
    assert spec.module_ranks == {n: lay.r["default"] for n, lay in layers.items()}
    assert spec.scales == pytest.approx({n: lay.scaling["default"] for n, lay in layers.items()})
    assert spec.rank == max(lay.r["default"] for lay in layers.values())
    targets = LORA_TARGETS if kw["target_modules"] == "all-linear" else kw["target_modules"]
    assert spec.target_modules == tuple(t for t in LORA_TARGETS if t in targets)
    assert spec.path == tmp_path / case and spec.base_model_name is not None
    if case == "patterns":
        assert spec.module_ranks["layers.1.q_proj"] == 8 and spec.module_ranks["layers.0.q_proj"] == 4
        assert spec.scales["layers.0.v_proj"] == 3 / 4 and spec.scales["layers.0.o_proj"] == 32 / 4
        assert spec.scales["layers.1.o_proj"] == 8 / 4 and spec.scales["layers.0.down_proj"] == 8 / 2
    if case.startswith("r8_rslora"):
        assert spec.scales["layers.0.q_proj"] == pytest.approx(16 / 8 ** 0.5)

    weights = load_adapter_weights(spec, torch.float32, lcfg(), args)
    assert set(weights) == set(layers)
    torch.manual_seed(0)
    for name, (a, b) in weights.items():
        lay = layers[name]
        x = torch.randn(3, a.shape[1])
        with torch.no_grad():
            want = lay.scaling["default"] * lay.lora_B["default"](lay.lora_A["default"](x))
        assert a.dtype == b.dtype == torch.float32 and a.device.type == "cpu"
        torch.testing.assert_close(x @ a.T @ b.T, want, rtol=1e-5, atol=1e-6)


def test_dtype_checksum_and_hashable(qv: tuple[Path, PeftModel], args: ModelArgs) -> None:
    d, _ = qv
    spec = inspect_adapter(d, lcfg(), args)
    raw = (d / "adapter_config.json").read_bytes() + (d / "adapter_model.safetensors").read_bytes()
    assert spec.checksum == hashlib.sha256(raw).hexdigest()
    assert spec == inspect_adapter(d, lcfg(), args) and len({spec, spec}) == 1
    f32 = load_adapter_weights(spec, torch.float32, lcfg(), args)
    bf16 = load_adapter_weights(spec, torch.bfloat16, lcfg(), args)
    for name, (a, b) in bf16.items():
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), f32[name][1], rtol=1e-2, atol=1e-3)


def test_changed_on_disk_after_inspect_is_refused(qv_copy: Path, args: ModelArgs) -> None:
    spec = inspect_adapter(qv_copy, lcfg(), args)
    t = load_file(qv_copy / "adapter_model.safetensors")
    save_file({k: v * 2 for k, v in t.items()}, qv_copy / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="changed on disk"):
        load_adapter_weights(spec, torch.float32, lcfg(), args)


def test_adapter_name_in_keys_is_normalised(qv: tuple[Path, PeftModel], qv_copy: Path, args: ModelArgs) -> None:
    t = load_file(qv_copy / "adapter_model.safetensors")
    renamed = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
               for k, v in t.items()}
    save_file(renamed, qv_copy / "adapter_model.safetensors")
    got = load_adapter_weights(inspect_adapter(qv_copy, lcfg(), args), torch.float32, lcfg(), args)
    want = load_adapter_weights(inspect_adapter(qv[0], lcfg(), args), torch.float32, lcfg(), args)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name][0], want[name][0]) and torch.equal(got[name][1], want[name][1])


def test_all_linear_string_in_config(qv_copy: Path, args: ModelArgs) -> None:
    # peft expands "all-linear" on save; hand-written configs may keep the shorthand.
    edit_config(qv_copy, target_modules="all-linear")
    assert inspect_adapter(qv_copy, lcfg(), args).target_modules == ("q_proj", "v_proj")
    with pytest.raises(AdapterError, match=r"'k_proj'.*lora\.target_modules"):
        inspect_adapter(qv_copy, lcfg(target_modules=QV), args)


@pytest.mark.parametrize("kw, message", [
    (dict(target_modules=QV, use_dora=True), "DoRA"),
    (dict(target_modules=QV, bias="all"), "bias='all'"),
    (dict(target_modules=QV, modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj", "lm_head"]), r"\['lm_head'\] not supported"),
    (dict(target_modules=QV, trainable_token_indices=[0, 1]), "added or trained tokens"),
])
def test_peft_features_we_refuse(kw: dict, message: str, tiny_model_dir: Path, args: ModelArgs,
                                 tmp_path: Path) -> None:
    make_adapter(tiny_model_dir, tmp_path / "a", r=4, lora_alpha=8, **kw)
    with pytest.raises(AdapterError, match=message) as e:
        inspect_adapter(tmp_path / "a", lcfg(), args)
    assert "adapter_config.json" in str(e.value)


def test_added_token_tensors_refused_even_with_clean_config(qv_copy: Path, args: ModelArgs) -> None:
    t = load_file(qv_copy / "adapter_model.safetensors")
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 10)
    save_file(t, qv_copy / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="embed_tokens.*added tokens"):
        inspect_adapter(qv_copy, lcfg(), args)


def test_rank_above_max(qv: tuple[Path, PeftModel], args: ModelArgs) -> None:
    with pytest.raises(AdapterError, match=r"rank 8, above lora\.max_lora_rank 4"):
        inspect_adapter(qv[0], lcfg(max_lora_rank=4), args)


def test_target_outside_lora_target_modules(qv: tuple[Path, PeftModel], args: ModelArgs) -> None:
    with pytest.raises(AdapterError, match=r"\['v_proj'\] not in lora\.target_modules"):
        inspect_adapter(qv[0], lcfg(target_modules=["q_proj", "k_proj"]), args)


def test_shapes_that_do_not_fit_the_base(qv: tuple[Path, PeftModel], args: ModelArgs) -> None:
    with pytest.raises(AdapterError, match=r"layers\.0\.q_proj.*expected lora_A \[8, 32\]"):
        inspect_adapter(qv[0], lcfg(), dataclasses.replace(args, hidden_size=32))
    with pytest.raises(AdapterError, match="layer 1, but the base model has 1 layers"):
        inspect_adapter(qv[0], lcfg(), dataclasses.replace(args, num_layers=1))


def test_rank_in_config_differs_from_tensors(qv_copy: Path, args: ModelArgs) -> None:
    edit_config(qv_copy, r=4)
    with pytest.raises(AdapterError, match=r"at rank 4: expected lora_A \[4, 64\]"):
        inspect_adapter(qv_copy, lcfg(), args)


def test_pickle_only_is_never_read(tiny_model_dir: Path, args: ModelArgs, tmp_path: Path) -> None:
    make_adapter(tiny_model_dir, tmp_path / "a", safe=False, r=4, lora_alpha=8, target_modules=QV)
    assert (tmp_path / "a" / "adapter_model.bin").exists()
    with pytest.raises(AdapterError, match="pickle is never read"):
        inspect_adapter(tmp_path / "a", lcfg(), args)


@pytest.mark.parametrize("keep", [100, 50, 0])
def test_truncated_safetensors(keep: int, qv_copy: Path, args: ModelArgs) -> None:
    f = qv_copy / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep < 100 else data[:-100])
    with pytest.raises(AdapterError, match="adapter_model.safetensors: corrupt or truncated"):
        inspect_adapter(qv_copy, lcfg(), args)


@pytest.mark.parametrize("damage, message", [
    ("no_config", "no adapter_config.json"),
    ("no_weights", "no adapter_model.safetensors"),
    ("bad_json", "not valid JSON"),
    ("ia3", "peft_type 'IA3' is not supported"),
])
def test_broken_dirs(damage: str, message: str, qv_copy: Path, args: ModelArgs) -> None:
    if damage == "no_config":
        (qv_copy / "adapter_config.json").unlink()
    elif damage == "no_weights":
        (qv_copy / "adapter_model.safetensors").unlink()
    elif damage == "bad_json":
        (qv_copy / "adapter_config.json").write_text("{not json")
    else:
        edit_config(qv_copy, peft_type="IA3")
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(qv_copy, lcfg(), args)


def test_resolve_adapter_path(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "good").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "file").write_text("x")
    roots = [str(root)]

    assert resolve_adapter_path(str(root / "good"), roots) == (root / "good").resolve()
    assert resolve_adapter_path(str(root / "x" / ".." / "good"), roots) == (root / "good").resolve()
    # A root given through a symlink still admits its real children.
    (tmp_path / "rootlink").symlink_to(root, target_is_directory=True)
    assert resolve_adapter_path(str(root / "good"), [str(tmp_path / "rootlink")]) == (root / "good").resolve()

    with pytest.raises(AdapterError, match="outside lora.adapter_roots"):
        resolve_adapter_path(str(root / ".." / "outside"), roots)
    with pytest.raises(AdapterError, match="outside lora.adapter_roots"):
        resolve_adapter_path(str(root / "link"), roots)
    with pytest.raises(AdapterError, match="outside lora.adapter_roots"):  # refused before existence
        resolve_adapter_path(str(tmp_path / "nowhere"), roots)
    with pytest.raises(AdapterError, match="does not exist"):
        resolve_adapter_path(str(root / "missing"), roots)
    with pytest.raises(AdapterError, match="not a directory"):
        resolve_adapter_path(str(root / "file"), roots)
    with pytest.raises(AdapterError, match="lora.adapter_roots is empty"):
        resolve_adapter_path(str(root / "good"), [])


def test_error_is_a_value_error() -> None:
    assert issubclass(AdapterError, ValueError)
    assert {f.name for f in dataclasses.fields(AdapterSpec)} == {
        "path", "rank", "target_modules", "module_ranks", "scales", "base_model_name", "checksum", "source", "revision"}
