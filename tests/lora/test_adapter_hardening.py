"""Hostile adapter directories against the loader (issue 29's adapter half), on real PEFT-format files.

- non-finite weights, or a lora_alpha whose scale overflows the served dtype once folded into B: refused
  at load, the registry unchanged;
- one read: a weights file swapped for a wrong-shape one between the loader's reads, or the adapter
  dir swapped for a symlink out of the roots after the check, is never registered; files far larger
  than they may be (a sparse 2 GiB config, bytes past the tensors' end) are refused unread;
- config parsing: rank_pattern / alpha_pattern keys match as PEFT's get_pattern_key does, but too many
  keys, or keys that would backtrack catastrophically, are refused at once; deep JSON nesting gives
  AdapterError, not RecursionError.
The same attacks through the HTTP admin API: tests/server/test_adapter_attacks.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.config.schema import LoRAConfig
from appliance.lora.adapter import AdapterError, adapter_weights, inspect_adapter, read_adapter
from appliance.lora.patterns import MAX_KEYS, Patterns
from appliance.models.llama import ModelArgs
from appliance.models.weights import read_hf_config
from tests.lora.test_lora_engine import make_adapter

KW = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def args(tiny_model_dir: Path) -> ModelArgs:
    return ModelArgs.from_hf_config(read_hf_config(tiny_model_dir))


@pytest.fixture(scope="module")
def made(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("hardening") / "qv4", seed=3, **KW)


@pytest.fixture
def adapter(made: Path, tmp_path: Path) -> Path:
    """A fresh copy of the qv4 adapter inside the root tmp_path/root."""
    import shutil

    return Path(shutil.copytree(made, tmp_path / "root" / "qv4"))


def cfg_for(d: Path, **kw: Any) -> LoRAConfig:
    return LoRAConfig(adapter_roots=[str(d.parent)], max_lora_rank=8, **kw)


def edit_config(d: Path, **changes: Any) -> None:
    p = d / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def rchar() -> int:
    """Bytes this process has read through read(2) and friends so far (Linux /proc)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


# ------------------------------------------------------------------ non-finite weights, overflowing scale

@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", ["lora_A", "lora_B"])
def test_non_finite_weights_are_refused(value: float, which: str, adapter: Path, args: ModelArgs) -> None:
    f = adapter / "adapter_model.safetensors"
    t = load_file(f)
    key = next(k for k in sorted(t) if f".{which}." in k)
    t[key][0, 0] = value
    save_file(t, f)
    spec, files = read_adapter(adapter, cfg_for(adapter), args)
    with pytest.raises(AdapterError, match=rf"{key}: holds NaN or Inf values"):
        adapter_weights(spec, files, torch.float32)


@pytest.mark.parametrize("alpha, dtype, refused", [
    (1e6, torch.float16, True),  # scale 2.5e5: B·scale beyond fp16's 65504
    (1e6, torch.bfloat16, False),
    (1e40, torch.float32, True),  # scale 2.5e39: beyond float32 (and so bfloat16)
    (1e40, torch.bfloat16, True),
    (1e40, torch.float64, False),
])
def test_alpha_whose_scale_overflows_the_served_dtype_is_refused(alpha: float, dtype: torch.dtype, refused: bool,
                                                                 adapter: Path, args: ModelArgs) -> None:
    edit_config(adapter, lora_alpha=alpha)
    spec, files = read_adapter(adapter, cfg_for(adapter), args)
    if not refused:
        assert all(torch.isfinite(b).all() for _, b in adapter_weights(spec, files, dtype).values())
        return
    with pytest.raises(AdapterError, match=rf"lora_B times its scale .* overflows {dtype}"):
        adapter_weights(spec, files, dtype)


def test_alpha_that_is_infinite_in_json_is_refused(adapter: Path, args: ModelArgs) -> None:
    p = adapter / "adapter_config.json"
    p.write_text(p.read_text().replace('"lora_alpha": 8', '"lora_alpha": 1e400'))
    with pytest.raises(AdapterError, match="lora_alpha for .* must be a finite number"):
        inspect_adapter(adapter, cfg_for(adapter), args)


def test_manager_refuses_a_nan_adapter_and_changes_nothing(adapter: Path, tiny_model_dir: Path) -> None:
    from tests.lora.test_lora_engine import lora_engine

    f = adapter / "adapter_model.safetensors"
    t = load_file(f)
    save_file({k: v.fill_(float("nan")) if ".lora_B." in k else v for k, v in t.items()}, f)
    engine = lora_engine(tiny_model_dir, adapter.parent)
    for pinned in (False, True):
        with pytest.raises(AdapterError, match="holds NaN or Inf"):
            engine.lora.load("nan", str(adapter), pinned=pinned)
        assert engine.lora.registry.entries() == [] and engine.lora.pool.stats().used == 0


# ------------------------------------------------------------------ one read

@pytest.fixture
def on_first_open() -> Iterator[Callable[[Callable[[str], bool], Callable[[], None]], None]]:
    """Arms a one-shot action run just before the first open(2) from Python whose path the predicate
    accepts (a sys audit hook: runs in this process, on whatever thread opens). The Rust safetensors
    reader opens no file through Python, so the hook sees only the loader's own opens."""
    state: dict[str, Any] = {}

    def hook(event: str, a: tuple) -> None:
        if event != "open" or "action" not in state or not state["match"](str(a[0])):
            return
        action = state.pop("action")
        action()

    if not getattr(sys, "_appliance_test_hook", None):
        sys.addaudithook(lambda e, a: sys._appliance_test_hook(e, a))  # type: ignore[attr-defined]
    sys._appliance_test_hook = hook  # type: ignore[attr-defined]

    def arm(match: Callable[[str], bool], action: Callable[[], None]) -> None:
        state.update(match=match, action=action)

    yield arm
    state.clear()
    sys._appliance_test_hook = lambda e, a: None  # type: ignore[attr-defined]


def wrong_shape_copy(d: Path, dest: Path) -> Path:
    """d's weights with every lora_A cut to half its columns: same keys, same rank, wrong in-features."""
    t = load_file(d / "adapter_model.safetensors")
    save_file({k: v[:, : v.shape[1] // 2].contiguous() if ".lora_A." in k else v for k, v in t.items()}, dest)
    return dest


@pytest.mark.parametrize("pinned", [False, True])
def test_weights_swapped_during_the_load_never_register_wrong_shapes(pinned: bool, adapter: Path, tmp_path: Path,
                                                                     tiny_model_dir: Path, on_first_open) -> None:
    """The swap happens just before the loader first opens the weights file itself (before the fix:
    the header had been checked by then, the checksum and the tensors came from the swapped file).
    Now the load is refused, or (had it read the good file whole) would register the good shapes; the
    engine serves on, and no slot is left pinned."""
    from appliance.engine.request import SamplingParams
    from tests.lora.test_lora_engine import lora_engine

    bad = wrong_shape_copy(adapter, tmp_path / "bad.safetensors")
    engine = lora_engine(tiny_model_dir, adapter.parent)
    on_first_open(lambda p: p.endswith("adapter_model.safetensors"),
                  lambda: os.replace(bad, adapter / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="do not fit this base model"):
        engine.lora.load("swapped", str(adapter), pinned=pinned)
    assert engine.lora.registry.entries() == [] and engine.lora.pool.stats().pinned == 0
    engine.add_request("0", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def test_dir_swapped_for_a_symlink_out_of_the_roots_after_the_check(adapter: Path, made: Path, tmp_path: Path,
                                                                    args: ModelArgs, on_first_open) -> None:
    """Check, then swap: the dir becomes a symlink to an adapter outside the roots just before the
    loader's first open. The descriptors are opened from the root without following symlinks: refused."""
    import shutil

    outside = Path(shutil.copytree(made, tmp_path / "outside" / "secret"))
    edit_config(outside, lora_alpha=4)  # a different adapter: a load that read it would show it

    def swap() -> None:
        adapter.rename(adapter.with_name("moved"))
        adapter.symlink_to(outside, target_is_directory=True)

    root = str(adapter.parent)
    on_first_open(lambda p: p.startswith(root) or "/" not in p, swap)
    with pytest.raises(AdapterError, match="changed while it was opened"):
        inspect_adapter(adapter, cfg_for(adapter), args)
    assert adapter.is_symlink()  # the swap did happen


def test_huge_sparse_config_is_refused_unread(adapter: Path, args: ModelArgs) -> None:
    with open(adapter / "adapter_config.json", "r+b") as f:
        f.truncate(2 << 30)  # 2 GiB, sparse: costs no disk
    before = rchar()
    with pytest.raises(AdapterError, match=r"adapter_config.json: 2147483648 bytes, more than the 1048576"):
        inspect_adapter(adapter, cfg_for(adapter), args)
    assert rchar() - before < 1 << 20


def test_weights_larger_than_their_header_declares_are_refused_unread(adapter: Path, args: ModelArgs) -> None:
    f = adapter / "adapter_model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size + (1 << 30))  # 1 GiB no tensor covers, sparse
    before = rchar()
    with pytest.raises(AdapterError, match=rf"more than the {size} its header declares"):
        inspect_adapter(adapter, cfg_for(adapter), args)
    assert rchar() - before < 1 << 20


def test_oversized_declared_shapes_are_refused_before_the_body_is_read(adapter: Path, args: ModelArgs) -> None:
    """A header declaring a 1 GiB lora_A (with a sparse body to match) fails the shape check unread."""
    t = load_file(adapter / "adapter_model.safetensors")
    a_key = next(k for k in sorted(t) if ".lora_A." in k)
    b_key = a_key.replace(".lora_A.", ".lora_B.")
    a_bytes, b_bytes = 4 * 4 * (1 << 26), t[b_key].numel() * 4
    header = {a_key: {"dtype": "F32", "shape": [4, 1 << 26], "data_offsets": [0, a_bytes]},
              b_key: {"dtype": "F32", "shape": list(t[b_key].shape), "data_offsets": [a_bytes, a_bytes + b_bytes]}}
    raw = json.dumps(header).encode()
    with open(adapter / "adapter_model.safetensors", "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + a_bytes + b_bytes)
    before = rchar()
    with pytest.raises(AdapterError, match=r"lora_A \[4, 67108864\] .* do not fit this base model"):
        inspect_adapter(adapter, cfg_for(adapter), args)
    assert rchar() - before < 1 << 20


# ------------------------------------------------------------------ rank_pattern / alpha_pattern, JSON depth

MODULES = [f"model.layers.{i}.{p}" for i in range(3) for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
    "mlp.up_proj", "mlp.down_proj")]
PEFT_KEYS = ["q_proj", "self_attn.v_proj", "layers.1.mlp.up_proj", "model.layers.2.self_attn.o_proj", "proj",
             "q.proj", r"layers\.[02]\..*", r".*\.(gate|up)_proj", r"model\.layers\.\d+\.mlp\.down_proj",
             "down_proj|k_proj", r"layers\.1\.self_attn\.[qk]_proj", "(?:q|v)_proj", r"mlp\.down_proj$"]


@pytest.mark.parametrize("key", PEFT_KEYS)
def test_pattern_keys_match_as_peft_does(key: str) -> None:
    from peft.utils.other import get_pattern_key

    p = Patterns({key: 1}, "rank_pattern", Path("c.json"))
    for m in MODULES:
        assert (p.value(m, 0) == 1) == (get_pattern_key([key], m) == key), (key, m)


def test_first_matching_key_wins_as_in_peft() -> None:
    from peft.utils.other import get_pattern_key

    keys = {r".*\.(q|v)_proj": 1, "q_proj": 2, "layers.1.self_attn.v_proj": 3, "mlp.up_proj": 4}
    p = Patterns(keys, "rank_pattern", Path("c.json"))
    for m in MODULES:
        assert p.value(m, 0) == keys.get(get_pattern_key(list(keys), m), 0), m


@pytest.mark.parametrize("key, message", [
    ("(a+)+$", "a repeat inside a repeat"),
    ("(.*a){20}", "a repeat inside a repeat"),
    ("(x|xx)*y", "an alternation inside a repeat"),
    (r"(q)\1", "backreferences"),
    (".*a.*b.*c", "3 repeats"),
    ("q" * 300, "more than 256"),
    ("(unclosed", "not a valid regex"),
])
def test_pathological_pattern_keys_are_refused(key: str, message: str, adapter: Path, args: ModelArgs) -> None:
    edit_config(adapter, rank_pattern={key: 4})
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(adapter, cfg_for(adapter), args)


def test_too_many_pattern_keys_are_refused(adapter: Path, args: ModelArgs) -> None:
    edit_config(adapter, rank_pattern={f"model.layers.{i}.self_attn.q_proj": 4 for i in range(10_000)})
    with pytest.raises(AdapterError, match=f"rank_pattern has 10000 keys, more than the {MAX_KEYS} allowed"):
        inspect_adapter(adapter, cfg_for(adapter), args)


def test_many_plain_keys_within_the_bound_still_match(adapter: Path, args: ModelArgs) -> None:
    keys = {f"model.layers.{i}.self_attn.q_proj": 4 for i in range(2, MAX_KEYS + 1)}
    keys["model.layers.1.self_attn.q_proj"] = 2
    edit_config(adapter, rank_pattern=keys)
    p = adapter / "adapter_model.safetensors"
    t = load_file(p)
    save_file({k: (v[:2] if ".lora_A." in k else v[:, :2]).contiguous() if "layers.1.self_attn.q_proj" in k else v
               for k, v in t.items()}, p)
    spec = inspect_adapter(adapter, cfg_for(adapter), args)
    assert spec.module_ranks["layers.1.q_proj"] == 2 and spec.module_ranks["layers.0.q_proj"] == 4


def test_target_modules_regex_is_checked_too(adapter: Path, args: ModelArgs) -> None:
    edit_config(adapter, target_modules="(.*q.*)+_proj")
    with pytest.raises(AdapterError, match="target_modules .* a repeat inside a repeat"):
        inspect_adapter(adapter, cfg_for(adapter), args)


@pytest.mark.parametrize("nesting", ["[", '{"a":'])
def test_deeply_nested_config_is_an_adapter_error(nesting: str, adapter: Path, args: ModelArgs) -> None:
    close = "]" if nesting == "[" else "}"
    body = json.loads((adapter / "adapter_config.json").read_text())
    text = json.dumps(body)[:-1] + ', "x": ' + nesting * 100_000 + "1" + close * 100_000 + "}"
    (adapter / "adapter_config.json").write_text(text)
    with pytest.raises(AdapterError, match="nested deeper than 32 levels"):
        inspect_adapter(adapter, cfg_for(adapter), args)
