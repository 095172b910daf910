"""`appliance validate`: everything that can be checked about a config without starting a server.

Schema (types, unknown keys, invariants) comes from compose; then the model directory's config.json
(and that parallel.tp_size divides it), then every adapter listed under `adapters:`: path inside lora.adapter_roots (or a remote URI under
lora.allowed_sources, fetched into the adapter cache), a PEFT dir we accept
(read from its config and safetensors header only, no weights), rank and targets within the engine's
LoRA settings, and the expectations written in the YAML. All problems are collected, one line each,
starting with the inventory file that defines the adapter (`adapters/team_a.yaml: adapters.x.rank: ...`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from appliance.config.compose import Composed, compose_tree
from appliance.config.schema import ApplianceConfig, ConfigError


def validate(config_dir: str | os.PathLike | None, overrides: Sequence[str]) -> tuple[Optional[ApplianceConfig], list[str]]:
    """The composed config (None when it does not compose) and every problem found, one line each."""
    composed, problems = validate_tree(config_dir, overrides)
    return (composed.cfg if composed is not None else None), problems


def validate_tree(config_dir: str | os.PathLike | None, overrides: Sequence[str],
                  layered: Optional[bool] = None) -> tuple[Optional[Composed], list[str]]:
    """validate, with the composed tree (which files, which values came from the environment). Values
    from the environment are redacted from the problems (config/env.py)."""
    try:
        composed = compose_tree(config_dir, overrides, layered=layered)
    except ConfigError as e:
        return None, [str(e)]
    return composed, [composed.env.redact(p) for p in _problems(composed)]


def _problems(composed: Composed) -> list[str]:
    cfg = composed.cfg
    from appliance.lora.adapter import AdapterError, inspect_adapter, resolve_adapter_path
    from appliance.models.args import ModelArgs
    from appliance.models.args import read_hf_config

    problems: list[str] = []
    args: Optional[ModelArgs] = None
    model_dir = Path(cfg.model.path).expanduser()
    try:
        args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    except ConfigError as e:
        hint = " (run `appliance model prepare`)" if cfg.model.source and not model_dir.exists() else ""
        problems.append(f"model.path: {e}{hint}")
    if args is not None:
        from appliance.parallel.layout import TPLayout

        try:
            TPLayout.check(args, cfg.parallel.tp_size)  # the tensor-parallel split must divide the model
        except ConfigError as e:
            problems.append(str(e))
    from appliance.lora.sources.fetch import AdapterSources, shown_as_source

    sources = AdapterSources(cfg.lora)
    for name, a in cfg.adapters.items():
        fetched = None
        try:
            local, fetched = sources.local(a.path)  # a remote URI: allowlist first, then fetched into the cache
            resolved = resolve_adapter_path(local, cfg.lora.read_roots())
            if args is None:
                continue  # shapes need the base model; its problem is already listed
            spec = inspect_adapter(resolved, cfg.lora, args)
        except AdapterError as e:
            problems.append(f"{composed.where(name)}adapters.{name}.path: {shown_as_source(e, fetched)}")
            continue
        problems += [composed.where(name) + m for m in a.mismatches(name, spec.rank, spec.target_modules,
                                                                    spec.base_model_name)]
    return problems
