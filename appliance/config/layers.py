"""The packaged default config tree, a user's overrides dir layered over it, and what differs.

The default tree ships inside the package (`appliance/default_configs`, package data; in a source
checkout a link to the repository's configs/), so an installed wheel composes with no --config-dir.

A config dir without its own config.yaml is an overrides dir: it holds only what differs (a
Kubernetes ConfigMap), and composes over the packaged tree file by file. A group file there is merged
key by key into the packaged file of the same path (its other keys, interpolations and defaults list
kept); an adapter inventory (adapters/*.yaml) and any file the package lacks are taken whole. A dir
with a config.yaml is a complete tree, composed alone as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from appliance.config.schema import ConfigError

PACKAGED_CONFIG_DIR = Path(__file__).resolve().parents[1] / "default_configs"


def is_overrides_dir(cdir: Path) -> bool:
    return cdir.is_dir() and not (cdir / "config.yaml").is_file() and cdir != PACKAGED_CONFIG_DIR.resolve()


def overlay(user: Path, tree: Path, shown_dir: Path) -> None:
    """Merge the (already bounded) snapshot `user` of an overrides dir into the snapshot `tree` of the
    packaged defaults; `shown_dir` names the user's dir in errors."""
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    for f in sorted(p for p in user.rglob("*") if p.is_file()):
        rel = f.relative_to(user)
        dest = tree / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel.parts[0] == "adapters" or not dest.is_file():
            dest.write_bytes(f.read_bytes())
            continue
        try:
            merged = OmegaConf.merge(OmegaConf.load(dest), OmegaConf.load(f))
        except (YAMLError, OmegaConfBaseException) as e:
            raise ConfigError(f"{shown_dir / rel}: {' '.join(str(e).split())}") from None
        dest.write_text(OmegaConf.to_yaml(merged))


def flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as `a.b.c` -> value; lists stay values."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def differences(defaults: dict, effective: dict) -> dict[str, tuple[Any, Any]]:
    """`key` -> (packaged default, effective value) for every key whose value differs (missing: None)."""
    a, b = flat(defaults), flat(effective)

    def filled(k: str, side: dict) -> bool:  # an empty mapping on one side whose keys the other side sets
        return any(x.startswith(k + ".") for x in side)

    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)
            and not (a.get(k) == {} and filled(k, b)) and not (b.get(k) == {} and filled(k, a))}
