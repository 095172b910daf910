"""Build one rank's shard of the model and fill it from safetensors slices (no rank reads it all).

The model file has no distributed code: `parallelize` adds from outside a hook that all-reduces each
attention and MLP block's output (row-parallel last linear, a LoRA delta inside it included) and a
vocab-parallel embedding. Logits are gathered by the model runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from appliance.models.args import ModelArgs, ModelConfigError
from appliance.models.llama import LlamaModel
from appliance.models.weights import build_empty, random_weights, read_hf_config, safetensors_files
from appliance.parallel.group import TPGroup
from appliance.parallel.layout import SPLIT, TPLayout

# HF key suffix -> (our module suffix, slice name or None) as in models/weights.py
_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding; tokens outside give 0 and the all-reduce fills them in.

    `weight` [V/size, H] keeps the name LlamaModel.compute_logits reads for tied embeddings, so the
    tied LM head is vocab-parallel too."""

    def __init__(self, weight: nn.Parameter, lo: int, hi: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.lo, self.hi = lo, hi
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [T] -> [T, H]; exactly one rank contributes each row, so the sum is exact.
        mine = (ids >= self.lo) & (ids < self.hi)
        x = F.embedding(torch.where(mine, ids - self.lo, 0), self.weight)
        x = x * mine[:, None].to(x.dtype)
        return self.group.all_reduce(x)


def parallelize(model: LlamaModel, layout: TPLayout, group: TPGroup) -> None:
    """Add the collectives to a model built from `layout.local_args()` (in place)."""
    def reduce_output(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(out)  # [T, H]: partial sums of the row-parallel linear (+ LoRA)

    for layer in model.layers:
        layer.self_attn.register_forward_hook(reduce_output)
        layer.mlp.register_forward_hook(reduce_output)
    lo, hi = layout.vocab_range()
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, lo, hi, group)


def load_shard(model_dir: str | Path, layout: TPLayout, group: TPGroup, dtype: torch.dtype,
               device: torch.device, max_len: int, init: str, seed: int) -> LlamaModel:
    """This rank's model: weights read as slices (init=weights) or cut from the seeded random stream."""
    model = build_empty(layout.local_args(), dtype, device, max_len)
    params = dict(model.named_parameters())
    seen: dict[str, int] = {}
    if init == "random":
        hf_cfg = read_hf_config(model_dir)
        stream = random_weights(layout.args, float(hf_cfg.get("initializer_range", 0.02)), seed, device)
        for key, t in stream:
            _copy_shard(key, _Full(t), params, layout, seen)
    else:
        for key, sl in _slices(model_dir):
            _copy_shard(key, sl, params, layout, seen)
    missing = {n for n, p in params.items() if seen.get(n, 0) != p.numel()}
    if missing:
        raise ModelConfigError(f"{model_dir}: weights missing for {sorted(missing)[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}")
    if layout.rank != 0 and layout.args.o_proj_bias:
        # The all-reduce sums every rank's o_proj output: only rank 0 adds the (replicated) bias.
        for layer in model.layers:
            layer.self_attn.o_proj.bias.data.zero_()
    parallelize(model, layout, group)
    model.eval()
    return model


class _Full:
    """A whole tensor with safetensors' slice interface (random init has no file)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __getitem__(self, idx: object) -> torch.Tensor:
        return self.t[idx]


def _slices(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """(HF key, lazy slice) of every tensor: `sl[lo:hi]` reads only those rows from the file."""
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                yield key, sf.get_slice(key)


def _copy_shard(key: str, sl: object, params: dict[str, nn.Parameter], layout: TPLayout,
                seen: dict[str, int]) -> None:
    a = layout.args
    if key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and a.tie_word_embeddings):
        return
    name = key[len("model."):] if key.startswith("model.") else key
    slice_name = None  # q|k|v or gate|up: where in our fused parameter this rank's rows go
    if name in ("embed_tokens.weight", "lm_head.weight"):
        lo, hi = layout.vocab_range()
        t = sl[lo:hi]  # type: ignore[index]
    else:
        pieces = name.split(".")  # layers.{i}.{self_attn|mlp}.{proj}.{weight|bias}
        proj = pieces[3] if len(pieces) == 5 and pieces[0] == "layers" else None
        split = SPLIT.get(proj) if proj is not None else None
        if split is None:
            t = sl[:]  # type: ignore[index]  # norms: replicated
        else:
            lo, hi = layout.proj_range(proj)  # type: ignore[arg-type]
            if split == "out":
                t = sl[lo:hi]  # type: ignore[index]  # weight rows or bias entries
            elif pieces[4] == "weight":
                t = sl[:, lo:hi]  # type: ignore[index]
            else:
                t = sl[:]  # type: ignore[index]  # o_proj bias: whole (kept on rank 0 only)
            if proj in _FUSED:
                mod, slice_name = _FUSED[proj]
                pieces[3] = mod
                name = ".".join(pieces)
    if name not in params:
        raise ModelConfigError(f"unexpected tensor {key!r} in checkpoint (not a {a.model_type} weight we know)")
    p = params[name]
    with torch.no_grad():
        dst = p
        if slice_name is not None:
            sizes = _local_slices(layout.local_args(), name)
            lo = _offset(sizes, slice_name)
            dst = p[lo:lo + dict(sizes)[slice_name]]
        if tuple(dst.shape) != tuple(t.shape):
            raise ModelConfigError(f"tensor {key!r}: rank {layout.rank}'s slice {tuple(t.shape)} does not fit "
                                   f"{tuple(dst.shape)}")
        dst.copy_(t.to(device=p.device, dtype=p.dtype))
    seen[name] = seen.get(name, 0) + t.numel()


def _local_slices(a: ModelArgs, name: str) -> list[tuple[str, int]]:
    if ".qkv_proj." in name:
        return [("q", a.q_size), ("k", a.kv_size), ("v", a.kv_size)]
    return [("gate", a.intermediate_size), ("up", a.intermediate_size)]


def _offset(sizes: list[tuple[str, int]], slice_name: str) -> int:
    lo = 0
    for s, n in sizes:
        if s == slice_name:
            return lo
        lo += n
    raise KeyError(slice_name)

