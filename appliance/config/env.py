"""Which config values came from the environment (`${oc.env:VAR}`), so they are never echoed.

Operators put secrets in the environment and interpolate them (keys, tokens in paths, private
directories). Wherever the server or the CLI shows a config value or a message that may contain one
(/v1/status, logs, error messages, the restart-required diff, `appliance plan`, `appliance config
show`), a value from the environment is shown as `<from env VAR>` instead:

- `mask(path, value)`: a setting whose YAML interpolates `${oc.env:...}` anywhere in it;
- `redact(text)`: every occurrence, in free text, of the value of a variable the config interpolates
  (values shorter than MIN_REDACTED_CHARS are left: "8000" or "true" hide nothing and would garble
  messages).

Found on the unresolved tree, so the rule holds whatever the value is; an interpolation of another key
(`${server.admin_key}`) is not followed. The values for `redact` are read through OmegaConf's own
`oc.env` resolver, like the config itself: library code reads no environment variable directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

_ENV = re.compile(r"\$\{oc\.env:\s*([^,}\s]+)")
MIN_REDACTED_CHARS = 4


@dataclass(frozen=True)
class EnvOrigins:
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key path -> the variables it reads
    values: dict[str, str] = field(default_factory=dict)  # variable -> its value, for `redact`

    @classmethod
    def of(cls, node: DictConfig) -> "EnvOrigins":
        """The env-derived keys of a composed, unresolved tree."""
        keys: dict[str, tuple[str, ...]] = {}
        _collect(OmegaConf.to_container(node, resolve=False), "", keys)
        values: dict[str, str] = {}
        for var in sorted({v for vs in keys.values() for v in vs}):
            value = OmegaConf.create({"v": "${oc.env:" + var + ",null}"}).v
            if value is not None and len(str(value)) >= MIN_REDACTED_CHARS:
                values[var] = str(value)
        return cls(keys, values)

    def merged(self, other: "EnvOrigins") -> "EnvOrigins":
        keys = {**self.keys}
        for k, vs in other.keys.items():
            keys[k] = tuple(sorted(set(keys.get(k, ())) | set(vs)))
        return EnvOrigins(keys, {**self.values, **other.values})

    def mask(self, path: str, value: Any) -> Any:
        vs = self.keys.get(path)
        return value if not vs else f"<from env {', '.join(vs)}>"

    def mask_tree(self, data: Any, path: str = "") -> Any:
        """`mask` over a nested dict of settings (`appliance config show`)."""
        if path in self.keys:
            return self.mask(path, data)
        if isinstance(data, dict):
            return {k: self.mask_tree(v, f"{path}.{k}" if path else str(k)) for k, v in data.items()}
        return data

    def redact(self, text: str) -> str:
        # Longest first, so a value containing another is replaced whole.
        for var, value in sorted(self.values.items(), key=lambda kv: -len(kv[1])):
            text = text.replace(value, f"<from env {var}>")
        return text

    def redact_all(self, obj: Any) -> Any:
        """`redact` over every string of a JSON-like value (an answer body before it is sent)."""
        if not self.values:
            return obj
        if isinstance(obj, str):
            return self.redact(obj)
        if isinstance(obj, dict):
            return {k: self.redact_all(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.redact_all(v) for v in obj]
        return obj


NO_ENV = EnvOrigins()


def _collect(node: Any, path: str, out: dict[str, tuple[str, ...]]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _collect(v, f"{path}.{k}" if path else str(k), out)
        return
    found = _ENV.findall(str(node)) if isinstance(node, (str, list)) else []
    if found:
        out[path] = tuple(sorted(set(found)))
