"""Desired and live adapter states for the plan: from the composed config, and from the server's view."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from appliance.config.schema import ApplianceConfig
from appliance.reconcile.plan import AdapterState


def desired_state(cfg: ApplianceConfig, engine_cfg: Optional[ApplianceConfig] = None
                  ) -> tuple[dict[str, AdapterState], dict[str, str]]:
    """The config's adapters with resolved paths and content checksums, and the ones that fail their
    checks (name -> why). They are checked against `engine_cfg`'s model and LoRA settings (the running
    engine's, in-process: a restart-only change in the YAML does not apply to them yet), else `cfg`'s.
    Reads adapter configs and safetensors headers and hashes the files: call it off the event loop."""
    from appliance.lora.adapter import AdapterError, inspect_adapter, resolve_adapter_path
    from appliance.models.args import ModelArgs
    from appliance.models.args import read_hf_config

    engine_cfg = engine_cfg or cfg
    args = ModelArgs.from_hf_config(read_hf_config(Path(engine_cfg.model.path).expanduser()))
    states: dict[str, AdapterState] = {}
    broken: dict[str, str] = {}
    from appliance.lora.sources.fetch import AdapterSources, shown_as_source

    sources = AdapterSources(engine_cfg.lora)
    for name, a in cfg.adapters.items():
        fetched = None
        try:
            # A remote URI is fetched at its current revision: a changed object shows as a new checksum.
            local, fetched = sources.local(a.path)
            spec = inspect_adapter(resolve_adapter_path(local, engine_cfg.lora.read_roots()), engine_cfg.lora, args)
        except AdapterError as e:
            broken[name] = str(shown_as_source(e, fetched))
            continue
        mismatches = a.mismatches(name, spec.rank, spec.target_modules, spec.base_model_name)
        if mismatches:
            broken[name] = "; ".join(mismatches)
            continue
        states[name] = AdapterState(name, fetched.source if fetched else str(spec.path), a.pinned, spec.checksum,
                                    revision=fetched.revision if fetched else "")
    return states, broken


def live_adapters(body: dict[str, Any]) -> dict[str, AdapterState]:
    """The adapters of a GET /v1/adapters body as AdapterStates."""
    return {d["name"]: AdapterState(d["name"], d["path"], bool(d["pinned"]), d["checksum"],
                                    managed=bool(d.get("managed", True)), revision=d.get("revision") or "")
            for d in body.get("data", [])}
