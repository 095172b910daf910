"""The same offline workload through transformers' `generate` (base) and peft (one adapter, then a
mixed batch of distinct adapters through `generate(adapter_names=...)`), on the same weights as the engine.

For model.init=random the transformers model is filled from the very `random_weights` stream the engine
used; for model.init=weights it is read from model.path. Prompts have equal lengths, so no padding.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from appliance.bench.offline import sync
from appliance.config.schema import ApplianceConfig


def available() -> Optional[str]:
    """None when transformers and peft import; else why the baselines are skipped."""
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"baselines skipped: {e}"
    return None


def build_hf_model(cfg: ApplianceConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from appliance.models.llama import ModelArgs
    from appliance.models.weights import random_weights, read_hf_config

    path = Path(cfg.model.path).expanduser()
    if cfg.model.init == "weights":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hf_cfg = read_hf_config(path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    sd = model.state_dict()
    args = ModelArgs.from_hf_config(hf_cfg)
    with torch.no_grad():
        for key, t in random_weights(args, float(hf_cfg.get("initializer_range", 0.02)), cfg.model.seed, device):
            sd[key].copy_(t)
    return model.eval()


def _generate(model: torch.nn.Module, prompts: Sequence[list[int]], new_tokens: int, device: torch.device,
              **kw: object) -> tuple[list[list[int]], float]:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
    sync(device)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t0


def run_baselines(cfg: ApplianceConfig, dtype: torch.dtype, device: torch.device, prompts: Sequence[list[int]],
                  new_tokens: int, adapter_dirs: Sequence[Path],
                  scale_to: Optional[int] = None) -> tuple[list[dict], list[list[int]]]:
    """Rows for transformers base, peft with adapter_dirs[0], peft mixed over all adapter_dirs (request i
    on adapter i % D); also the peft one-adapter tokens (the oracle for the engine's).

    Each is timed twice: 1 new token (the prefill, "prefill_s") and `new_tokens`; the difference gives
    its time per further token ("token_ms"). scale_to (> new_tokens): the bounded run's figures extended
    to that many new tokens, est_tok_s = batch * scale_to / (prefill_s + (scale_to - 1) * token_ms),
    what the full-length run would have measured were every further token as slow."""
    from peft import PeftModel

    model = build_hf_model(cfg, dtype, device)
    model.generation_config.eos_token_id = None  # never stop early: exactly new_tokens, like ignore_eos
    rows = []
    n = len(prompts) * new_tokens

    def timed(impl: str, adapters: int, m: torch.nn.Module, **kw: object) -> list[list[int]]:
        # Warm-up on the full batch (2 tokens), not timed: allocator growth and kernel choices at this shape.
        _generate(m, prompts, 2, device, **kw)
        _, t1 = _generate(m, prompts, 1, device, **kw)
        toks, wall = _generate(m, prompts, new_tokens, device, **kw)
        row = {"impl": impl, "adapters": adapters, "batch": len(prompts), "new_tokens": new_tokens,
               "tokens": n, "wall_s": round(wall, 4), "tok_s": round(n / wall, 2), "prefill_s": round(t1, 4)}
        if new_tokens > 1:
            per = max(wall - t1, 0.0) / (new_tokens - 1)
            row["token_ms"] = round(per * 1e3, 3)
            if scale_to is not None and scale_to > new_tokens:
                row["est_new_tokens"] = scale_to
                row["est_tok_s"] = round(len(prompts) * scale_to / (t1 + (scale_to - 1) * per), 2)
        rows.append(row)
        return toks

    timed("transformers", 0, model)
    pm = PeftModel.from_pretrained(model, str(adapter_dirs[0]), adapter_name="a0").eval()
    one = timed("peft", 1, pm)
    if len(adapter_dirs) > 1:
        for i, d in enumerate(adapter_dirs[1:], start=1):
            pm.load_adapter(str(d), adapter_name=f"a{i}")
        names = [f"a{i % len(adapter_dirs)}" for i in range(len(prompts))]
        timed("peft mixed", len(adapter_dirs), pm, adapter_names=names)
    del pm, model
    return rows, one
