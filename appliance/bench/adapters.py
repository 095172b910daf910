"""Synthetic LoRA adapters written as real PEFT directories (adapter_config.json + adapter_model.safetensors).

The engine reads them through the same path as any adapter (lora.adapter_roots, inspect, checksum), and
peft's `PeftModel.from_pretrained` reads them unchanged, so a baseline and the engine serve the very
same weights. A ~ N(0, 1/in) and B ~ N(0, std²) with the base model's init std and lora_alpha = 2·r:
the update is a visible but modest fraction of each projection's output.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors.torch import save_file

from appliance.models.llama import ModelArgs

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def proj_shape(proj: str, a: ModelArgs) -> tuple[int, int]:
    """(in features, out features) of one projection."""
    return a.proj_shape(proj)


def adapter_numel(a: ModelArgs, rank: int, targets: Iterable[str]) -> int:
    """Elements of one adapter's A and B over all layers: what a step with it must read once."""
    return a.num_layers * sum(rank * sum(proj_shape(t, a)) for t in targets)


def write_adapter(dest: Path, args: ModelArgs, rank: int, targets: Iterable[str], seed: int, std: float,
                  dtype: torch.dtype, device: torch.device, base_model: Optional[str] = None) -> Path:
    """One PEFT LoRA dir at `dest`; the weights follow from `seed` alone (generated on `device`)."""
    targets = list(targets)
    g = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(args.num_layers):
        for t in targets:
            in_f, out_f = proj_shape(t, args)
            key = f"base_model.model.model.layers.{layer}.{_PARENT[t]}.{t}"
            a = torch.empty(rank, in_f, device=device).normal_(0.0, in_f ** -0.5, generator=g)
            b = torch.empty(out_f, rank, device=device).normal_(0.0, std, generator=g)
            tensors[f"{key}.lora_A.weight"] = a.to(dtype).cpu()
            tensors[f"{key}.lora_B.weight"] = b.to(dtype).cpu()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "base_model_name_or_path": base_model, "inference_mode": True}
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return dest


def served_shape(model_path: Path, dtype: str) -> tuple[ModelArgs, float, torch.dtype]:
    """What synthetic adapters for a served model need: its shape, its init std (B's std) and the
    adapters' dtype (float32 for a float32 model, else bf16)."""
    from appliance.models.weights import read_hf_config

    hf = read_hf_config(model_path.expanduser())
    return (ModelArgs.from_hf_config(hf), float(hf.get("initializer_range", 0.02)),
            torch.float32 if dtype == "float32" else torch.bfloat16)


def adapter_name(rank: int, i: int) -> str:
    return f"r{rank}-{i:04d}"


def make_adapters(root: Path, args: ModelArgs, rank: int, count: int, targets: Iterable[str], std: float,
                  dtype: torch.dtype, device: torch.device, base_model: Optional[str] = None,
                  progress: bool = True) -> dict[str, Path]:
    """`count` distinct adapters of `rank` under `root` (name -> dir); existing dirs are reused."""
    from tqdm import tqdm

    out: dict[str, Path] = {}
    for i in tqdm(range(count), desc=f"adapters rank {rank}", disable=not progress or count < 2, leave=False):
        name = adapter_name(rank, i)
        d = root / name
        if not (d / "adapter_model.safetensors").is_file():
            write_adapter(d, args, rank, targets, zlib.crc32(name.encode()), std, dtype, device, base_model)
        out[name] = d
    return out
