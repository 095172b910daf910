"""Read and validate PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors).

`inspect_adapter` reads the JSON and only the safetensors header, so a bad adapter is refused before any
weight reaches memory. `load_adapter_weights` then reads the tensors, checks they are the very bytes that
were inspected (checksum) and folds each module's scale into B, so a backend computes y += (x Aᵀ) Bᵀ.
Pickle (`adapter_model.bin`) is never read. Modules are named `layers.{i}.{proj}`, proj in LORA_TARGETS.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from safetensors import SafetensorError, safe_open

from appliance.config.schema import LORA_TARGETS, LoRAConfig
from appliance.models.args import ModelArgs

if TYPE_CHECKING:  # torch only where tensors are read: validate, plan and apply only inspect headers
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_CHUNK = 1 << 20
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
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


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the file/key (HTTP 400)."""


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


@dataclass
class _Module:
    name: str  # layers.{i}.{proj}
    peft_name: str  # model.layers.{i}.self_attn.q_proj: what rank_pattern / alpha_pattern keys match
    proj: str
    keys: dict[str, str] = field(default_factory=dict)  # "A" | "B" -> tensor key in the file


def resolve_adapter_path(path: str, roots: list[str]) -> Path:
    """The real directory `path` names, refused unless it lies inside one of `roots`.

    Symlinks and `..` are resolved first, so neither can escape a root; nothing is read before the check.
    """
    if not roots:
        raise AdapterError(f"{path}: refused: lora.adapter_roots is empty, so no adapter path is allowed")
    if not str(path).strip():
        raise AdapterError("adapter path is empty")
    try:
        real = Path(path).expanduser().resolve(strict=False)
        real_roots = [Path(r).expanduser().resolve(strict=False) for r in roots]
    except (OSError, RuntimeError, ValueError) as e:  # symlink loop, NUL byte, unknown ~user
        raise AdapterError(f"{path}: cannot resolve: {e}") from e
    if not any(real.is_relative_to(r) for r in real_roots):
        raise AdapterError(f"{path}: resolves to {real}, outside lora.adapter_roots {list(roots)}")
    if not real.exists():
        raise AdapterError(f"{path}: does not exist")
    if not real.is_dir():
        raise AdapterError(f"{path}: is not a directory (expected a PEFT adapter directory)")
    # The files are read through the dir, so a symlinked file could still lead out of the roots.
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        f = real / name
        if f.is_symlink():
            try:
                target = f.resolve(strict=False)
            except (OSError, RuntimeError) as e:
                raise AdapterError(f"{path}: {name}: cannot resolve: {e}") from e
            if not any(target.is_relative_to(r) for r in real_roots):
                raise AdapterError(f"{path}: {name} resolves to {target}, outside lora.adapter_roots "
                                   f"{list(roots)}")
    return real


def inspect_adapter(path: Path, lora_cfg: LoRAConfig, args: ModelArgs) -> AdapterSpec:
    """Validate a PEFT LoRA dir against the engine's LoRA config and base model; reads no tensor data."""
    cfg_path = path / CONFIG_FILE
    cfg_bytes, cfg = _read_config(path)
    wfile = _weights_file(path)
    _check_options(cfg, cfg_path)
    declared = _declared_targets(cfg.get("target_modules"), args, cfg_path)
    try:
        # numpy, not pt: only the header is read, and "pt" would import torch (seconds) into the CLI.
        with safe_open(str(wfile), framework="numpy") as sf:
            header = {k: (list(sf.get_slice(k).get_shape()), sf.get_slice(k).get_dtype()) for k in sf.keys()}
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{wfile}: corrupt or truncated safetensors: {e}") from e
    modules = _group(header, wfile, args.num_layers)

    present = {m.proj for m in modules.values()}
    allowed = lora_cfg.resolved_targets()
    refused = [t for t in LORA_TARGETS if t in declared | present and t not in allowed]
    if refused:
        raise AdapterError(f"{cfg_path}: target module(s) {refused} not in lora.target_modules {list(allowed)}")

    ranks: dict[str, int] = {}
    scales: dict[str, float] = {}
    for m in modules.values():
        r, scale = _rank_and_scale(cfg, m.peft_name, cfg_path)
        if r > lora_cfg.max_lora_rank:
            raise AdapterError(f"{cfg_path}: {m.name} has rank {r}, above lora.max_lora_rank "
                               f"{lora_cfg.max_lora_rank}")
        (a_shape, a_dt), (b_shape, b_dt) = header[m.keys["A"]], header[m.keys["B"]]
        in_f, out_f = _in_out(m.proj, args)
        if a_shape != [r, in_f] or b_shape != [out_f, r]:
            raise AdapterError(f"{wfile}: {m.name}: lora_A {a_shape} / lora_B {b_shape} do not fit this base "
                               f"model at rank {r}: expected lora_A [{r}, {in_f}] and lora_B [{out_f}, {r}]")
        for key, dt in ((m.keys["A"], a_dt), (m.keys["B"], b_dt)):
            if dt not in _FLOAT_DTYPES:
                raise AdapterError(f"{wfile}: {key}: dtype {dt} is not a float type {_FLOAT_DTYPES}")
        ranks[m.name], scales[m.name] = r, scale

    base = cfg.get("base_model_name_or_path")
    return AdapterSpec(
        path=path, rank=max(ranks.values()), target_modules=tuple(t for t in LORA_TARGETS if t in present),
        module_ranks=ranks, scales=scales, base_model_name=str(base) if base is not None else None,
        checksum=_checksum_file(cfg_bytes, wfile))


def load_adapter_weights(spec: AdapterSpec, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`layers.{i}.{proj}` -> (A [r, in], B [out, r] · scale), on CPU in `dtype`.

    The weights file is read into memory once, hashed and parsed from the same bytes, so what we load is
    exactly what inspect_adapter validated (a file changed on disk since then is refused, not half-loaded).
    """
    import torch
    from safetensors.torch import load as load_safetensors_bytes

    if not dtype.is_floating_point:
        raise AdapterError(f"{spec.path}: cannot load LoRA weights as non-float dtype {dtype}")
    cfg_bytes, _ = _read_config(spec.path)
    wfile = _weights_file(spec.path)
    try:
        data = wfile.read_bytes()
    except OSError as e:
        raise AdapterError(f"{wfile}: cannot read: {e}") from e
    h = hashlib.sha256(cfg_bytes)
    h.update(data)
    if h.hexdigest() != spec.checksum:
        raise AdapterError(f"{spec.path}: adapter files changed on disk since they were inspected "
                           "(checksum differs); load it again")
    try:
        tensors = load_safetensors_bytes(data)
    except SafetensorError as e:
        raise AdapterError(f"{wfile}: corrupt or truncated safetensors: {e}") from e
    modules = _group(tensors, wfile, num_layers=None)
    if set(modules) != set(spec.module_ranks):
        raise AdapterError(f"{wfile}: modules {sorted(modules)} differ from the inspected {sorted(spec.module_ranks)}")
    # Scale in at least float32 before the cast so bf16/fp16 round once, not twice.
    work = torch.promote_types(dtype, torch.float32)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, m in modules.items():
        a, b, r = tensors[m.keys["A"]], tensors[m.keys["B"]], spec.module_ranks[name]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"{wfile}: {name}: lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                               f"do not match the inspected rank {r}")
        out[name] = (a.to(dtype).contiguous(), (b.to(work) * spec.scales[name]).to(dtype).contiguous())
    return out


def _read_config(path: Path) -> tuple[bytes, dict[str, Any]]:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        raw = cfg_path.read_bytes()
        cfg = json.loads(raw)
    except OSError as e:
        raise AdapterError(f"{cfg_path}: cannot read: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_path}: not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return raw, cfg


def _weights_file(path: Path) -> Path:
    wfile = path / WEIGHTS_FILE
    if wfile.is_file():
        return wfile
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise AdapterError(f"{path}: only pickle weights (adapter_model.bin) found; pickle is never read: "
                           "save the adapter with safe_serialization=True")
    raise AdapterError(f"{path}: no {WEIGHTS_FILE}")


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
        try:
            hits = {n.rsplit(".", 1)[-1] for n in names + ["lm_head", "model.embed_tokens"] if re.fullmatch(tm, n)}
        except re.error as e:
            raise AdapterError(f"{cfg_path}: target_modules {tm!r} is not a valid regex: {e}") from e
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


def _pattern_value(patterns: dict[str, Any], module: str, default: Any, cfg_path: Path) -> Any:
    # Same rule as peft.utils.other.get_pattern_key: the first key (a regex) matching a dotted suffix wins.
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as e:
            raise AdapterError(f"{cfg_path}: pattern key {key!r} is not a valid regex: {e}") from e
    return default


def _rank_and_scale(cfg: dict[str, Any], peft_name: str, cfg_path: Path) -> tuple[int, float]:
    r = _pattern_value(cfg.get("rank_pattern") or {}, peft_name, cfg.get("r", 8), cfg_path)
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, peft_name, cfg.get("lora_alpha", 8), cfg_path)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{cfg_path}: rank for {peft_name} must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{cfg_path}: lora_alpha for {peft_name} must be a number, got {alpha!r}")
    # PEFT: rsLoRA scales by alpha/sqrt(r) so larger ranks do not shrink the update.
    return r, float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)


def _in_out(proj: str, a: ModelArgs) -> tuple[int, int]:
    h, i, q, kv = a.hidden_size, a.intermediate_size, a.q_size, a.kv_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[proj]


def _checksum_file(cfg_bytes: bytes, wfile: Path) -> str:
    h = hashlib.sha256(cfg_bytes)
    try:
        with wfile.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as e:
        raise AdapterError(f"{wfile}: cannot read: {e}") from e
    return h.hexdigest()
