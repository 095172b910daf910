"""Read and validate PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors).

`read_adapter` reads a directory once (lora/adapter_files.py) and validates config and header before
the body, so what was checked is what is loaded; `inspect_adapter` returns only the spec;
`load_adapter_weights` re-reads a registered adapter, refuses a checksum change, NaN/Inf or a scaled B
that overflows the served dtype, and folds each module's scale into B. Pickle is never read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from appliance.config.schema import LORA_TARGETS, LoRAConfig
from appliance.lora.adapter_files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterFiles,
    TensorInfo,
    read_adapter_files,
    resolve_adapter_path,
)
from appliance.lora.patterns import Patterns, fullmatches
from appliance.models.args import ModelArgs

if TYPE_CHECKING:  # torch only where tensors are read: validate, plan and apply only inspect
    import torch

__all__ = ["AdapterError", "AdapterSpec", "CONFIG_FILE", "WEIGHTS_FILE", "adapter_weights", "inspect_adapter",
           "load_adapter_weights", "read_adapter", "resolve_adapter_path"]
Weights = dict[str, tuple["torch.Tensor", "torch.Tensor"]]
# The float types an adapter may hold: safetensors dtype names -> torch's (the format is little-endian).
_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_FLOAT_DTYPES = tuple(_TORCH_DTYPES)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT options that add weights or change the math beyond y += scale·(x Aᵀ) Bᵀ: refused when set.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora=true)",
    "lora_bias": "a bias on lora_B (lora_bias=true)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "trainable_token_indices": "added or trained tokens (trainable_token_indices)",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora=true)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "megatron_config": "Megatron-sharded LoRA (megatron_config)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
# PEFT writes `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (adapter name stripped);
# some writers keep the adapter name: `...q_proj.lora_A.default.weight`.
_KEY_RE = re.compile(r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<proj>\w+))"
                     r"\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class AdapterSpec:
    """What inspect_adapter learnt from an adapter dir. Hashable: the dicts follow from path + checksum."""

    path: Path
    rank: int  # max over modules: the slot rank it needs
    target_modules: tuple[str, ...]  # projections with weights, in LORA_TARGETS order
    module_ranks: dict[str, int] = field(compare=False)  # "layers.{i}.{proj}" -> r
    scales: dict[str, float] = field(compare=False)  # "layers.{i}.{proj}" -> alpha/r or alpha/sqrt(r)
    base_model_name: Optional[str]  # PEFT's base_model_name_or_path (informational, not enforced)
    checksum: str  # sha256 of adapter_config.json bytes + adapter_model.safetensors bytes
    # The remote URI it was fetched from (path is then its disk-cache entry); None: a local dir.
    source: Optional[str] = field(default=None, compare=False)
    # Its revision there (etag:... for s3, commit:... for hf); None: a local dir.
    revision: Optional[str] = field(default=None, compare=False)


@dataclass
class _Module:
    name: str  # layers.{i}.{proj}
    peft_name: str  # model.layers.{i}.self_attn.q_proj: what rank_pattern / alpha_pattern keys match
    proj: str
    keys: dict[str, str] = field(default_factory=dict)  # "A" | "B" -> tensor key in the file


def read_adapter(path: str | Path, lora_cfg: LoRAConfig, args: ModelArgs) -> tuple[AdapterSpec, AdapterFiles]:
    """Read the adapter dir at `path` (confined to lora_cfg.adapter_roots) once and validate it against
    the engine's LoRA config and base model; the spec and the bytes it was made from."""
    files, fields = read_adapter_files(path, lora_cfg.read_roots(), partial(_validate, lora_cfg=lora_cfg, args=args))
    return AdapterSpec(path=files.path, checksum=files.checksum, **fields), files


def inspect_adapter(path: str | Path, lora_cfg: LoRAConfig, args: ModelArgs) -> AdapterSpec:
    """`read_adapter`'s spec alone (validate, plan): the files are read once, their bytes dropped."""
    return read_adapter(path, lora_cfg, args)[0]


def load_adapter_weights(spec: AdapterSpec, dtype: torch.dtype, lora_cfg: LoRAConfig, args: ModelArgs) -> Weights:
    """A cold read of a registered adapter: its dir read and validated again (confined to the roots
    again: it may have been replaced by a symlink since), refused unless the bytes are the ones
    registered (checksum), then `adapter_weights`."""
    try:
        spec_now, files = read_adapter(spec.path, lora_cfg, args)
    except AdapterError as e:
        raise AdapterError(f"{e} (the adapter's files changed on disk since it was registered)") from e
    if spec_now.checksum != spec.checksum:
        raise AdapterError(f"{spec.path}: adapter files changed on disk since they were inspected "
                           "(checksum differs); load it again")
    return adapter_weights(spec_now, files, dtype)


def adapter_weights(spec: AdapterSpec, files: AdapterFiles, dtype: torch.dtype) -> Weights:
    """`layers.{i}.{proj}` -> (A [r, in], B [out, r] · scale), on CPU in `dtype`, parsed from the very
    bytes `spec` was made from. Refused (AdapterError) when a weight is NaN or Inf, or does not fit
    `dtype` once scaled (a lora_alpha so large that B · scale overflows). All tensors are views of one
    new pageable buffer (never page-locked: side-stream copies go through lora/staging.py's buffers)."""
    import torch

    if not dtype.is_floating_point:
        raise AdapterError(f"{spec.path}: cannot load LoRA weights as non-float dtype {dtype}")
    wfile = files.path / WEIGHTS_FILE
    modules = _group(files.tensors, wfile, num_layers=None)
    if set(modules) != set(spec.module_ranks):
        raise AdapterError(f"{wfile}: modules {sorted(modules)} differ from the inspected {sorted(spec.module_ranks)}")
    for name, m in modules.items():
        a, b, r = files.tensors[m.keys["A"]], files.tensors[m.keys["B"]], spec.module_ranks[name]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"{wfile}: {name}: lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                               f"do not match the inspected rank {r}")
    src = _tensor_views(files, wfile)
    order = [(name, m.keys["A"], m.keys["B"]) for name, m in modules.items()]
    if not _all_finite(_body_checks(files, src)):  # one reduction; the key is looked for only on failure
        for _, ka, kb in order:
            for key in (ka, kb):
                if not bool(torch.isfinite(src[key]).all()):
                    raise AdapterError(f"{wfile}: {key}: holds NaN or Inf values; refused")
    # Scale in at least float32 before the cast so bf16/fp16 round once, not twice.
    work = torch.promote_types(dtype, torch.float32)
    flat = torch.empty(sum(src[ka].numel() + src[kb].numel() for _, ka, kb in order), dtype=dtype)
    out: Weights = {}
    off = 0
    for name, ka, kb in order:
        a, b = src[ka], src[kb]
        a_out = flat[off:off + a.numel()].view(a.shape)
        off += a.numel()
        b_out = flat[off:off + b.numel()].view(b.shape)
        off += b.numel()
        a_out.copy_(a)
        if b.dtype == dtype:  # the CPU kernels compute b · scale in float32 (opmath), rounding once
            torch.mul(b, spec.scales[name], out=b_out)
        else:
            b_out.copy_(b.to(work) * spec.scales[name])
        out[name] = (a_out, b_out)
    if not _all_finite([flat]):
        for name, ka, kb in order:
            a_out, b_out = out[name]
            if not bool(torch.isfinite(a_out).all()):
                raise AdapterError(f"{wfile}: {ka}: values overflow {dtype}; refused")
            if not bool(torch.isfinite(b_out).all()):
                raise AdapterError(f"{wfile}: {kb}: lora_B times its scale {spec.scales[name]:g} (lora_alpha / r) "
                                   f"overflows {dtype}; refused (lower lora_alpha)")
    return out


def _tensor_views(files: AdapterFiles, wfile: Path) -> dict[str, "torch.Tensor"]:
    """Every tensor as a zero-copy view of `files.body`, at the span the checked header gave it (a span
    not aligned to its element size is copied: views must be aligned)."""
    import sys

    import torch

    if sys.byteorder != "little":
        raise AdapterError(f"{wfile}: safetensors is little-endian; this host is not")
    raw = torch.frombuffer(files.body, dtype=torch.uint8) if files.body else torch.empty(0, dtype=torch.uint8)
    out = {}
    for key, t in files.tensors.items():
        if t.dtype not in _TORCH_DTYPES:
            raise AdapterError(f"{wfile}: {key}: dtype {t.dtype} is not a float type {_FLOAT_DTYPES}")
        dt = getattr(torch, _TORCH_DTYPES[t.dtype])
        span = raw[t.begin:t.end]
        if t.begin % dt.itemsize:
            span = span.clone()
        out[key] = span.view(dt).view(t.shape)
    return out


def _body_checks(files: AdapterFiles, views: dict[str, "torch.Tensor"]) -> list["torch.Tensor"]:
    """What the finite check reads: the whole body as one tensor when every tensor has one dtype (they
    tile it), else each tensor."""
    import torch

    dtypes = {t.dtype for t in files.tensors.values()}
    if len(dtypes) == 1 and files.body:  # (_tensor_views refused any dtype but the float ones)
        return [torch.frombuffer(files.body, dtype=getattr(torch, _TORCH_DTYPES[dtypes.pop()]))]
    return list(views.values())


def _all_finite(tensors: list["torch.Tensor"]) -> bool:
    """No NaN or Inf in any of `tensors`: one sum each (NaN or Inf anywhere makes it non-finite, so a
    finite sum proves none; CPU sums accumulate in float32 or wider). A sum that overflowed finite
    values gives False too: the caller then checks element-wise. Why a sum: docs/performance.md."""
    import torch

    return all(t.numel() == 0 or bool(torch.isfinite(t.sum())) for t in tensors)


def _validate(cfg: dict[str, Any], header: dict[str, TensorInfo], wfile: Path, lora_cfg: LoRAConfig,
              args: ModelArgs) -> dict[str, Any]:
    """AdapterSpec's fields from the config and the safetensors header; AdapterError when it cannot be
    served. Runs before the weights' body is read (adapter_files.read_adapter_files)."""
    cfg_path = wfile.parent / CONFIG_FILE
    _check_options(cfg, cfg_path)
    declared = _declared_targets(cfg.get("target_modules"), args, cfg_path)
    modules = _group(header, wfile, args.num_layers)

    present = {m.proj for m in modules.values()}
    allowed = lora_cfg.resolved_targets()
    refused = [t for t in LORA_TARGETS if t in declared | present and t not in allowed]
    if refused:
        raise AdapterError(f"{cfg_path}: target module(s) {refused} not in lora.target_modules {list(allowed)}")

    rank_p = Patterns(cfg.get("rank_pattern"), "rank_pattern", cfg_path)
    alpha_p = Patterns(cfg.get("alpha_pattern"), "alpha_pattern", cfg_path)
    ranks: dict[str, int] = {}
    scales: dict[str, float] = {}
    for m in modules.values():
        r, scale = _rank_and_scale(cfg, rank_p, alpha_p, m.peft_name, cfg_path)
        if r > lora_cfg.max_lora_rank:
            raise AdapterError(f"{cfg_path}: {m.name} has rank {r}, above lora.max_lora_rank "
                               f"{lora_cfg.max_lora_rank}")
        a, b = header[m.keys["A"]], header[m.keys["B"]]
        in_f, out_f = _in_out(m.proj, args)
        if list(a.shape) != [r, in_f] or list(b.shape) != [out_f, r]:
            raise AdapterError(f"{wfile}: {m.name}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                               f"this base model at rank {r}: expected lora_A [{r}, {in_f}] and lora_B [{out_f}, {r}]")
        for key, dt in ((m.keys["A"], a.dtype), (m.keys["B"], b.dtype)):
            if dt not in _FLOAT_DTYPES:
                raise AdapterError(f"{wfile}: {key}: dtype {dt} is not a float type {_FLOAT_DTYPES}")
        ranks[m.name], scales[m.name] = r, scale

    base = cfg.get("base_model_name_or_path")
    return dict(rank=max(ranks.values()), target_modules=tuple(t for t in LORA_TARGETS if t in present),
                module_ranks=ranks, scales=scales, base_model_name=str(base) if base is not None else None)


def _check_options(cfg: dict[str, Any], cfg_path: Path) -> None:
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{cfg_path}: bias={cfg['bias']!r} is not supported (only 'none')")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise AdapterError(f"{cfg_path}: {what} is not supported")


def _declared_targets(tm: Any, args: ModelArgs, cfg_path: Path) -> set[str]:
    """Projection names adapter_config.json's target_modules names (the tensors may cover fewer)."""
    if tm is None:  # PEFT fills in model defaults at training time; the tensors say what was trained
        return set()
    if isinstance(tm, str):
        if tm.lower() == "all-linear":  # PEFT: every linear but the output layer
            return set(LORA_TARGETS)
        # PEFT: any other string is a regex that must match the whole module name.
        names = [f"model.layers.{i}.{_PARENT[p]}.{p}" for i in range(args.num_layers) for p in LORA_TARGETS]
        hits = {n.rsplit(".", 1)[-1] for n in fullmatches(tm, names + ["lm_head", "model.embed_tokens"],
                                                          "target_modules", cfg_path)}
    elif isinstance(tm, list) and all(isinstance(t, str) for t in tm):
        hits = {t.rsplit(".", 1)[-1] for t in tm}  # suffixes: "q_proj", "self_attn.q_proj", full names
    else:
        raise AdapterError(f"{cfg_path}: target_modules must be a list of names or a string, got {tm!r}")
    bad = sorted(hits - set(LORA_TARGETS))
    if bad:
        raise AdapterError(f"{cfg_path}: target module(s) {bad} not supported; LoRA may target only "
                           f"{', '.join(LORA_TARGETS)}")
    return hits


def _group(keys: Iterable[str], wfile: Path, num_layers: Optional[int]) -> dict[str, _Module]:
    """Tensor keys -> modules with both lora_A and lora_B; anything else in the file is refused."""
    modules: dict[str, _Module] = {}
    for key in keys:
        if "embed_tokens" in key or "lm_head" in key:
            raise AdapterError(f"{wfile}: {key}: embedding / lm_head weights (added tokens) are not supported")
        m = _KEY_RE.match(key)
        if m is None or _PARENT.get(m["proj"]) != m["parent"]:
            what = "DoRA magnitude" if "lora_magnitude_vector" in key else "unexpected"
            raise AdapterError(f"{wfile}: {key}: {what} tensor; only lora_A/lora_B weights of "
                               f"{', '.join(LORA_TARGETS)} are supported")
        layer = int(m["layer"])
        if num_layers is not None and layer >= num_layers:
            raise AdapterError(f"{wfile}: {key}: layer {layer}, but the base model has {num_layers} layers")
        name = f"layers.{layer}.{m['proj']}"
        peft_name = m["module"].removeprefix("base_model.model.")
        mod = modules.setdefault(name, _Module(name, peft_name, m["proj"]))
        if m["ab"] in mod.keys:
            raise AdapterError(f"{wfile}: {key}: duplicate of {mod.keys[m['ab']]}")
        mod.keys[m["ab"]] = key
    if not modules:
        raise AdapterError(f"{wfile}: holds no LoRA weights")
    for mod in modules.values():
        if len(mod.keys) != 2:
            missing = "lora_B" if "A" in mod.keys else "lora_A"
            raise AdapterError(f"{wfile}: {mod.name}: {missing} weight missing")
    return modules


def _rank_and_scale(cfg: dict[str, Any], rank_p: Patterns, alpha_p: Patterns, peft_name: str,
                    cfg_path: Path) -> tuple[int, float]:
    r = rank_p.value(peft_name, cfg.get("r", 8))
    alpha = alpha_p.value(peft_name, cfg.get("lora_alpha", 8))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{cfg_path}: rank for {peft_name} must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{cfg_path}: lora_alpha for {peft_name} must be a finite number, got {alpha!r}")
    # PEFT: rsLoRA scales by alpha/sqrt(r) so larger ranks do not shrink the update.
    try:
        scale = float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    except OverflowError as e:  # an int alpha beyond float's range
        raise AdapterError(f"{cfg_path}: lora_alpha for {peft_name} is too large: {e}") from e
    return r, scale


def _in_out(proj: str, a: ModelArgs) -> tuple[int, int]:
    h, i, q, kv = a.hidden_size, a.intermediate_size, a.q_size, a.kv_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[proj]
