"""Compose the Hydra config tree (Compose API) into a checked `ApplianceConfig`.

We use `initialize_config_dir` + `compose` rather than `@hydra.main`: the CLI owns argv, the server
can re-compose on reload, and nothing changes the working directory or sets up logging behind our back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from appliance.config.env import NO_ENV, EnvOrigins
from appliance.config.file_limits import snapshot_config_files
from appliance.config.layers import PACKAGED_CONFIG_DIR, is_overrides_dir, overlay
from appliance.config.schema import ApplianceConfig, ConfigError, register_configs
from appliance.lora.names import adapter_key

# The packaged default tree (config/layers.py): the repository's configs/ in a checkout, package data
# in a wheel.
DEFAULT_CONFIG_DIR = PACKAGED_CONFIG_DIR
# Hydra's GlobalHydra is process-wide: the server's reconciler and a test may compose at once.
_HYDRA_LOCK = threading.Lock()


@dataclass(frozen=True)
class Composed:
    cfg: ApplianceConfig
    # Adapter name -> the file that defines it (relative to the config dir), for error messages.
    adapter_files: dict[str, str]
    # Which values came from ${oc.env:...}: shown as <from env VAR>, never echoed (config/env.py).
    env: EnvOrigins = field(default_factory=EnvOrigins)

    def where(self, name: str) -> str:
        """`<file>: ` for an adapter defined in a file, else '' (it came from an override)."""
        f = self.adapter_files.get(name)
        return f"{f}: " if f else ""


def compose_config(config_dir: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                   config_name: str = "config") -> ApplianceConfig:
    """Compose `config_name` from `config_dir` with Hydra overrides; raise ConfigError with the key path."""
    return compose_tree(config_dir, overrides, config_name).cfg


def resolve_config_dir(config_dir: str | os.PathLike | None) -> Path:
    return (Path(config_dir) if config_dir is not None else DEFAULT_CONFIG_DIR).expanduser().resolve()


def compose_tree(config_dir: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                 config_name: str = "config", layered: bool | None = None) -> Composed:
    """compose_config, also telling which file each adapter comes from. `layered`: the dir is an
    overrides dir (config/layers.py); None = as the dir looks now. A server fixes it at start, so a
    complete tree caught mid-copy without its config.yaml fails to compose instead of composing as
    overrides."""
    cdir = resolve_config_dir(config_dir)
    if layered is None:
        layered = config_name == "config" and is_overrides_dir(cdir)
    if not layered and not (cdir / f"{config_name}.yaml").is_file():
        raise ConfigError(f"{cdir / (config_name + '.yaml')}: config file not found")
    register_configs()
    with tempfile.TemporaryDirectory(prefix="appliance-config-") as snap:
        # Size and (alias-expanded) node count checked on one read of each file; Hydra composes
        # those bytes, not whatever a save puts in the dir meanwhile.
        if layered:  # an overrides dir over the packaged defaults (config/layers.py)
            snapshot_config_files(PACKAGED_CONFIG_DIR, Path(snap))
            with tempfile.TemporaryDirectory(prefix="appliance-overrides-") as user:
                snapshot_config_files(cdir, Path(user))
                overlay(Path(user), Path(snap), cdir)
        else:
            snapshot_config_files(cdir, Path(snap))
        return _compose_snapshot(cdir, Path(snap), overrides, config_name)


def _compose_snapshot(cdir: Path, snap: Path, overrides: Sequence[str], config_name: str) -> Composed:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    env = NO_ENV
    with _HYDRA_LOCK:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(snap), version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=list(overrides))
                defaults = GlobalHydra.instance().config_loader().compute_defaults_list(
                    config_name, list(overrides), RunMode.RUN).defaults
            env = EnvOrigins.of(cfg)
            _reject_unknown_keys(cfg, ApplianceConfig, "")
            obj = OmegaConf.to_object(cfg)  # resolves ${oc.env:...} and builds the dataclasses
        except (HydraException, OmegaConfBaseException, YAMLError) as e:
            # A YAML syntax error comes unwrapped; its message names the file, line and column. A value
            # from the environment that does not fit its type is not repeated.
            raise ConfigError(env.redact(f"{cdir}: {_one_line(e)}".replace(str(snap), str(cdir)))) from None
        finally:
            GlobalHydra.instance().clear()
    if not isinstance(obj, ApplianceConfig):
        raise ConfigError(f"{cdir / (config_name + '.yaml')}: defaults list must start with appliance_schema")
    # The adapters group is multi-select: Hydra merges its files silently, a later file's `name:`
    # replacing an earlier one's. Two teams claiming one name is a mistake, so it is an error here.
    files = [d.config_path for d in defaults
             if d.package == "adapters" and d.config_path and d.config_path.startswith("adapters/")]
    files.append(config_name)  # the root file may list adapters too (`_self_`)
    composed = Composed(obj, _adapter_files(snap, files), env)
    try:
        obj.check()
    except ConfigError as e:
        msg = str(e)
        name = next((n for n in composed.adapter_files if msg.startswith((adapter_key(n) + ".", adapter_key(n) + ":"))),
                    "")
        where = composed.where(name)
        if msg.startswith("tenants."):  # the tenants group file that holds it
            where = next((f"{d.config_path}.yaml: " for d in defaults
                          if d.config_path and d.config_path.startswith("tenants/")), "")
        raise ConfigError(env.redact(f"{where}{e}")) from None
    return composed


def _adapter_files(cdir: Path, config_paths: list[str]) -> dict[str, str]:
    """Adapter name -> defining file; ConfigError when a name is defined in two files."""
    out: dict[str, str] = {}
    for cp in config_paths:
        rel = f"{cp}.yaml"
        raw = OmegaConf.load(cdir / rel)  # composed fine a moment ago, so it parses
        names = raw.keys() if cp.startswith("adapters/") else (raw.get("adapters") or {}).keys()
        for name in names:
            if name in out:
                raise ConfigError(f"{adapter_key(str(name))}: defined in both {out[name]} and {rel}; an adapter name "
                                  "must be unique across the selected adapters files")
            out[str(name)] = rel
    return out


def _reject_unknown_keys(node: object, schema: type, prefix: str) -> None:
    """Hydra's `+key=value` appends bypass struct mode; refuse keys the schema does not have."""
    from omegaconf import DictConfig

    import typing

    hints = typing.get_type_hints(schema)  # resolves the string annotations of `from __future__`
    assert isinstance(node, DictConfig)
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{path}: unknown key (not in {schema.__name__})")
        sub_schema = hints[key]
        sub = node._get_node(key)
        if isinstance(sub, DictConfig) and isinstance(sub_schema, type) and dataclasses.is_dataclass(sub_schema):
            _reject_unknown_keys(sub, sub_schema, path + ".")


def _one_line(e: BaseException) -> str:
    # Hydra wraps the OmegaConf error; the innermost message carries full_key / object_type.
    msgs = []
    cur: BaseException | None = e
    while cur is not None:
        msgs.append(str(cur).strip())
        cur = cur.__cause__ or cur.__context__
    out: list[str] = []
    for m in msgs:
        m = " ".join(m.split())
        if m and not any(m in o for o in out):
            out.append(m)
    return " | ".join(out)


def config_to_dict(cfg: ApplianceConfig) -> dict:
    """A composed config as plain JSON-able data (resolved), e.g. for a tensor-parallel worker."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(data, dict)
    return data


def config_from_dict(data: dict) -> ApplianceConfig:
    """The inverse of config_to_dict: the typed config again (types checked by OmegaConf)."""
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ApplianceConfig), data))
    assert isinstance(obj, ApplianceConfig)
    return obj


def config_hash(cfg: ApplianceConfig) -> str:
    """Stable content hash of a composed config (the reconciler stops early when it is unchanged)."""
    return hashlib.sha256(json.dumps(config_to_dict(cfg), sort_keys=True).encode()).hexdigest()[:16]
