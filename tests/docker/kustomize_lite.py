"""Renders docker/k8s overlays the way `kubectl kustomize` does, for exactly the features they use
(no kustomize binary installs from PyPI; the `kustomize` name there is an unrelated generator):
`resources` (files and directories holding a kustomization.yaml) and `patches` by `path` applied as
strategic merge onto the resource of the same kind and name. Lists of named items (containers,
volumes, env, ...) merge by name, ports by containerPort; other lists are replaced whole, as the
Kubernetes types' patch strategies say. Anything else in a kustomization.yaml is refused, so a
manifest using more than this fails here rather than rendering wrongly."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

_SUPPORTED = {"apiVersion", "kind", "resources", "patches"}
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "name",
               "env": "name", "ports": "containerPort"}


def render(kustomize_dir: Path) -> list[dict[str, Any]]:
    """Every object the kustomization in kustomize_dir builds, in resource order."""
    spec = yaml.safe_load((kustomize_dir / "kustomization.yaml").read_text())
    unknown = set(spec) - _SUPPORTED
    if unknown:
        raise ValueError(f"{kustomize_dir}/kustomization.yaml: unsupported fields {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for res in spec.get("resources", []):
        path = kustomize_dir / res
        if path.is_dir():
            objects += render(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o is not None]
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{kustomize_dir}: only patches by path are supported, got {patch}")
        body = yaml.safe_load((kustomize_dir / patch["path"]).read_text())
        key = (body["kind"], body["metadata"]["name"])
        targets = [i for i, o in enumerate(objects) if (o["kind"], o["metadata"]["name"]) == key]
        if len(targets) != 1:
            raise ValueError(f"{kustomize_dir / patch['path']}: {len(targets)} objects match {key}")
        objects[targets[0]] = merge(objects[targets[0]], body)
    return objects


def merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Strategic merge of patch onto base (a new object; neither argument changes)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _MERGE_KEYS.get(key or ""):
        field = _MERGE_KEYS[key or ""]
        out = copy.deepcopy(base)
        for item in patch:
            at = [i for i, b in enumerate(out) if b.get(field) == item.get(field)]
            if at:
                out[at[0]] = merge(out[at[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)
