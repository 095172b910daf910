"""A Llama-family model's shape and options, read from its config.json: `ModelArgs`.

Torch-free, so that the commands that only check a config or its adapters against the model
(`appliance validate`, `plan`, `apply`) start without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from appliance.config.schema import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class ModelConfigError(ConfigError):
    """The checkpoint's config.json describes something this model file cannot run."""


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2, Llama attention_bias=true)
    rope_scaling: Optional[dict[str, Any]] = None  # e.g. {"rope_type": "llama3", "factor": 8, ...}
    model_type: str = "llama"
    o_proj_bias: bool = False  # Llama's attention_bias also biases o_proj; Qwen2's qkv bias does not
    # Mistral/Qwen2 sliding-window attention: we attend to the full context, which is only the same
    # model when the context never exceeds the window (the model runner caps max_model_len to it).
    sliding_window: Optional[int] = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def proj_shape(self, proj: str) -> tuple[int, int]:
        """(in features, out features) of one projection (q_proj ... down_proj)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[proj]

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> "ModelArgs":
        mt = c.get("model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(f"config.json: model_type {mt!r} is not one of {SUPPORTED_MODEL_TYPES}")
        if c.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"config.json: hidden_act {c.get('hidden_act')!r} is not supported (silu only)")
        if c.get("mlp_bias"):
            raise ModelConfigError("config.json: mlp_bias=true is not supported")
        # transformers >= 5 writes rope settings under rope_parameters; older configs use top-level keys.
        rope = dict(c.get("rope_parameters") or {})
        scaling = c.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") not in ("default", None):
            scaling = rope
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type"))
            if rtype in ("default", None):
                scaling = None
            elif rtype not in ("llama3", "linear"):
                raise ModelConfigError(f"config.json: rope scaling type {rtype!r} is not supported (llama3, linear)")
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", mt == "qwen2")),
            rope_scaling=scaling,
            model_type=mt,
            o_proj_bias=bool(c.get("attention_bias", False)) and mt != "qwen2",
            sliding_window=(c.get("sliding_window") if (mt == "mistral" or c.get("use_sliding_window"))
                            else None),
        )


def read_hf_config(model_dir: str | Path) -> dict:
    p = Path(model_dir) / "config.json"
    if not p.is_file():
        raise ModelConfigError(f"{p}: not found (model.path must be a local HF model directory)")
    return json.loads(p.read_text())
