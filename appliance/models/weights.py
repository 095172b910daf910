"""Load a local HF model directory (config.json + safetensors) into our LlamaModel, or (model.init=random)
fill it from config.json alone with seeded random weights.

Only safetensors are read (never pickle). Tensors are streamed one at a time from the files into the
already-allocated parameters, so peak memory is the model plus one tensor. HF's per-projection weights
are copied into the right slice of our fused qkv / gate_up linears.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from appliance.models.args import ModelArgs, ModelConfigError, read_hf_config
from appliance.models.llama import LlamaModel, RotaryEmbedding

# HF name suffix -> (our module suffix, slice name or None for a plain copy)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def safetensors_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        bins = list(d.glob("*.bin")) + list(d.glob("*.pt"))
        hint = " (only pickle weights found; they are never loaded: convert to safetensors)" if bins else ""
        raise ModelConfigError(f"{d}: no *.safetensors weights{hint}")
    return files


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_len: int) -> LlamaModel:
    """Build the model on `device` in `dtype` and fill it from the directory's safetensors."""
    args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    model = build_empty(args, dtype, device, max_len)
    params = dict(model.named_parameters())
    # Elements filled per parameter: a fused parameter is complete once all its slices arrived.
    seen: dict[str, int] = {}
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                _copy_one(key, sf.get_tensor(key), params, args, seen)
    missing = {n for n, p in params.items() if seen.get(n, 0) != p.numel()}
    if missing:
        raise ModelConfigError(f"{model_dir}: weights missing for {sorted(missing)[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}")
    model.eval()
    return model


def random_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_len: int,
                 seed: int) -> LlamaModel:
    """The model of `model_dir/config.json` filled from `random_weights` (no safetensors read)."""
    hf_cfg = read_hf_config(model_dir)
    args = ModelArgs.from_hf_config(hf_cfg)
    model = build_empty(args, dtype, device, max_len)
    params = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for key, t in random_weights(args, float(hf_cfg.get("initializer_range", 0.02)), seed, device):
        _copy_one(key, t, params, args, seen)
    assert all(seen.get(n, 0) == p.numel() for n, p in params.items()), "random_weights missed a parameter"
    model.eval()
    return model


def hf_weight_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF checkpoint key -> shape for a Llama-family model (transformers' LlamaForCausalLM names)."""
    h, i, q, kv = args.hidden_size, args.intermediate_size, args.q_size, args.kv_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, h)}
    for n in range(args.num_layers):
        pre = f"model.layers.{n}."
        out[pre + "input_layernorm.weight"] = (h,)
        out[pre + "post_attention_layernorm.weight"] = (h,)
        for proj, (o, k) in {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}.items():
            out[pre + f"self_attn.{proj}.weight"] = (o, k)
            if args.attention_bias and (proj != "o_proj" or args.o_proj_bias):
                out[pre + f"self_attn.{proj}.bias"] = (o,)
        for proj, (o, k) in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
            out[pre + f"mlp.{proj}.weight"] = (o, k)
    out["model.norm.weight"] = (h,)
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = (args.vocab_size, h)
    return out


def random_weights(args: ModelArgs, std: float, seed: int, device: torch.device
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, float32 tensor on `device`) for every weight, one at a time: matrices ~ N(0, std²) (HF's
    init), norms 1, biases 0. Each tensor has its own generator seeded from (seed, key), so the values do
    not depend on the order or on which keys a consumer takes: our loader and a transformers baseline
    built from the same stream get the same model."""
    for key, shape in hf_weight_shapes(args).items():
        if key.endswith("norm.weight"):
            yield key, torch.ones(shape, device=device)
        elif key.endswith(".bias"):
            yield key, torch.zeros(shape, device=device)
        else:
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            yield key, torch.empty(shape, device=device).normal_(0.0, std, generator=g)


def build_empty(args: ModelArgs, dtype: torch.dtype, device: torch.device, max_len: int) -> LlamaModel:
    """The model with uninitialised parameters in `dtype` on `device` (no time spent on random init)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaModel(args, max_len)
    finally:
        torch.set_default_dtype(prev)
    model.to_empty(device=device)
    with torch.device(device):
        model.rope = RotaryEmbedding(args, max_len)  # fp32 tables, computed for real (not meta)
    return model


def _copy_one(key: str, t: torch.Tensor, params: dict[str, torch.nn.Parameter], args: ModelArgs,
              seen: dict[str, int]) -> None:
    if key == "lm_head.weight" and args.tie_word_embeddings:
        return  # some checkpoints store the tied head too
    if key.endswith("rotary_emb.inv_freq"):
        return
    m = _LAYER_RE.match(key)
    if key.startswith("model."):
        name = key[len("model."):]
    else:
        name = key
    slice_name = None
    if m:
        layer, mod, kind = m.groups()
        if mod in _FUSED:
            mod, slice_name = _FUSED[mod]
        name = f"layers.{layer}.{mod}.{kind}"
    if name not in params:
        raise ModelConfigError(f"unexpected tensor {key!r} in checkpoint (not a {args.model_type} weight we know)")
    p = params[name]
    with torch.no_grad():
        if slice_name is None:
            dst = p
        else:
            lo, hi = _slice_offsets(args, name, slice_name)
            dst = p[lo:hi]
        if tuple(dst.shape) != tuple(t.shape):
            raise ModelConfigError(f"tensor {key!r}: shape {tuple(t.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(t.to(p.dtype))
    seen[name] = seen.get(name, 0) + t.numel()


def _slice_offsets(args: ModelArgs, name: str, slice_name: str) -> tuple[int, int]:
    if ".qkv_proj." in name:
        sizes = {"q": args.q_size, "k": args.kv_size, "v": args.kv_size}
    else:
        sizes = {"gate": args.intermediate_size, "up": args.intermediate_size}
    lo = 0
    for n, s in sizes.items():
        if n == slice_name:
            return lo, lo + s
        lo += s
    raise KeyError(slice_name)
