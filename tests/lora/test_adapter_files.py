"""The adapter's weights are views of the bytes read once, at the spans our own header parse checked: they
equal safetensors' own load tensor for tensor (mixed dtypes, a span not aligned to its element size,
an empty tensor), and a header whose offsets or dtype do not describe the body is refused before the
body is read. The full adapter path on the same views: test_adapter.py (peft) and
test_adapter_hardening.py (NaN / Inf / overflow refusals)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file

from appliance.bench.adapters import write_adapter
from appliance.config.schema import LoRAConfig
from appliance.lora.adapter import AdapterError, _tensor_views, adapter_weights, read_adapter
from appliance.lora.adapter_files import WEIGHTS_FILE, read_adapter_files
from appliance.models.llama import ModelArgs
from appliance.models.weights import read_hf_config

_ST = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def raw_safetensors(tensors: list[tuple[str, torch.Tensor]], header_pad: int = 0) -> bytes:
    """A safetensors file with the tensors' bytes packed back to back in the given order, with no
    alignment padding (safetensors' own writer aligns; the format does not require it)."""
    header: dict[str, Any] = {}
    body = b""
    for key, t in tensors:
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[key] = {"dtype": _ST[t.dtype], "shape": list(t.shape), "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    h = json.dumps(header).encode() + b" " * header_pad
    return struct.pack("<Q", len(h)) + h + body


def write_dir(d: Path, weights: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text("{}")
    (d / WEIGHTS_FILE).write_bytes(weights)
    return d


def read_views(d: Path) -> dict[str, torch.Tensor]:
    files, _ = read_adapter_files(d, [str(d.parent)], lambda *_: None)
    return _tensor_views(files, d / WEIGHTS_FILE)


def assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
        assert torch.equal(ours[k].view(torch.uint8), theirs[k].view(torch.uint8)), k  # bit for bit (NaN too)


def test_views_equal_safetensors_own_load_for_every_tensor(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [("half_odd", torch.randn(3, 5, generator=g).half()),  # 30 bytes: what follows is unaligned
               ("f32_unaligned", torch.randn(7, 3, generator=g)),
               ("bf16", torch.randn(4, 9, generator=g).bfloat16()),
               ("empty", torch.empty(0, 16)),
               ("f64_unaligned", torch.randn(2, 3, generator=g).double()),
               ("special", torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 3e38]))]
    for pad in (0, 1, 3):  # the body's own start within the file is unaligned as well
        raw = raw_safetensors(tensors, header_pad=pad)
        d = write_dir(tmp_path / f"pad{pad}", raw)
        assert_same(read_views(d), safetensors_load(raw))


def test_views_of_a_file_written_by_safetensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    t = {f"t{i}": torch.randn(i + 1, 2 * i + 3, generator=g).to(dt)
         for i, dt in enumerate([torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.bfloat16])}
    d = tmp_path / "st"
    d.mkdir()
    save_file(t, str(d / WEIGHTS_FILE))
    (d / "adapter_config.json").write_text("{}")
    assert_same(read_views(d), safetensors_load((d / WEIGHTS_FILE).read_bytes()))


def test_adapter_weights_equal_the_reference_formula(tmp_path: Path) -> None:
    """A as stored (cast to the served dtype), B · scale computed in float32 then rounded once: bit for bit,
    for a bf16 8B-shape-like adapter served in bf16 and float32, and a float32 one served in bf16."""
    args = ModelArgs.from_hf_config(read_hf_config(Path("appliance/models/shapes/llama-3.1-8b")))
    args.num_layers = 2
    cfg = LoRAConfig(adapter_roots=[str(tmp_path)], max_lora_rank=16)
    for stored in (torch.bfloat16, torch.float32):
        d = write_adapter(tmp_path / str(stored), args, 16, ["q_proj", "down_proj"], seed=0, std=0.02,
                          dtype=stored, device=torch.device("cpu"))
        ref = safetensors_load((d / WEIGHTS_FILE).read_bytes())
        spec, files = read_adapter(d, cfg, args)
        for served in (torch.bfloat16, torch.float32):
            w = adapter_weights(spec, files, served)
            for i in range(2):
                for proj, parent in (("q_proj", "self_attn"), ("down_proj", "mlp")):
                    key = f"base_model.model.model.layers.{i}.{parent}.{proj}"
                    a, b = w[f"layers.{i}.{proj}"]
                    scale = spec.scales[f"layers.{i}.{proj}"]
                    assert torch.equal(a, ref[f"{key}.lora_A.weight"].to(served))
                    assert torch.equal(b, (ref[f"{key}.lora_B.weight"].float() * scale).to(served))


def test_a_value_that_overflows_the_served_dtype_is_refused(tmp_path: Path) -> None:
    args = ModelArgs.from_hf_config(read_hf_config(Path("appliance/models/shapes/llama-3.1-8b")))
    args.num_layers = 1
    d = write_adapter(tmp_path / "a", args, 4, ["q_proj"], seed=0, std=0.02, dtype=torch.float32,
                      device=torch.device("cpu"))
    t = safetensors_load((d / WEIGHTS_FILE).read_bytes())
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    t[key][1, 2] = 1e6  # finite in float32, beyond float16's 65504
    save_file(t, str(d / WEIGHTS_FILE))
    spec, files = read_adapter(d, LoRAConfig(adapter_roots=[str(tmp_path)], max_lora_rank=8), args)
    assert torch.isfinite(adapter_weights(spec, files, torch.bfloat16)["layers.0.q_proj"][0]).all()
    with pytest.raises(AdapterError, match=rf"{key}: values overflow torch.float16"):
        adapter_weights(spec, files, torch.float16)


@pytest.mark.parametrize("edit, message", [
    (lambda h: h["b"].update(data_offsets=[24, 44]), r"'b': data_offsets \[24, 44\] do not hold shape \[4\]"),
    (lambda h: h["b"].update(data_offsets=[20, 36]), r"'b' starts at 20, expected 24"),  # overlaps 'a'
    (lambda h: h["b"].update(data_offsets=[28, 44]), r"'b' starts at 28, expected 24"),  # a gap
    (lambda h: h["a"].update(data_offsets=[-4, 20]), r"'a' starts at -4, expected 0"),  # before the body
    (lambda h: h["a"].update(data_offsets=["0", 24]), r"'a': data_offsets \['0', 24\]"),
    (lambda h: h["a"].update(dtype="F12"), r"'a': missing or unknown dtype"),
    (lambda h: h["a"].update(dtype="F16"), r"'a': data_offsets \[0, 24\] do not hold shape \[2, 3\] of F16"),
    (lambda h: h["b"].update(shape=[2, 3]), r"'b': data_offsets \[24, 40\] do not hold shape \[2, 3\]"),
    (lambda h: h.update(c={"dtype": "F32", "shape": [1], "data_offsets": [40, 44]}), r"truncated .* but its header declares"),
])
def test_a_header_that_does_not_describe_the_body_is_refused(edit: Any, message: str, tmp_path: Path) -> None:
    raw = raw_safetensors([("a", torch.ones(2, 3)), ("b", torch.ones(4))])
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    h = json.dumps(header).encode()
    d = write_dir(tmp_path / "bad", struct.pack("<Q", len(h)) + h + raw[8 + n:])
    with pytest.raises(AdapterError, match=message):
        read_views(d)
