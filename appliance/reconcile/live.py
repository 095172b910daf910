"""Desired and live adapter states for the plan: from the composed config, and from a server's API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from appliance.config.schema import ApplianceConfig
from appliance.reconcile.plan import AdapterState


class LiveStateError(Exception):
    """The server could not be read (down, wrong URL, wrong admin key); the message says which."""


def desired_state(cfg: ApplianceConfig) -> dict[str, AdapterState]:
    """The config's adapters with resolved paths and content checksums (call after validate passed)."""
    from appliance.lora.adapter import inspect_adapter, resolve_adapter_path
    from appliance.models.llama import ModelArgs
    from appliance.models.weights import read_hf_config

    args = ModelArgs.from_hf_config(read_hf_config(Path(cfg.model.path).expanduser()))
    out = {}
    for name, a in cfg.adapters.items():
        spec = inspect_adapter(resolve_adapter_path(a.path, cfg.lora.adapter_roots), cfg.lora, args)
        out[name] = AdapterState(name, str(spec.path), a.pinned, spec.checksum)
    return out


def live_state(url: str, admin_key: str | None, timeout_s: float = 30.0) -> dict[str, AdapterState]:
    """GET {url}/v1/adapters with the admin key: the server's adapters as AdapterStates."""
    req = urllib.request.Request(url.rstrip("/") + "/v1/adapters")
    if admin_key:
        req.add_header("Authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = e.reason
        raise LiveStateError(f"{url}/v1/adapters answered {e.code}: {msg}") from None
    except (urllib.error.URLError, OSError) as e:
        raise LiveStateError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None
    return {d["name"]: AdapterState(d["name"], d["path"], bool(d["pinned"]), d["checksum"])
            for d in body.get("data", [])}
