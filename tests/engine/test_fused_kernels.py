"""engine.fused_kernels: the engine with the fused Triton kernels (interpreter on CPU) gives the greedy
tokens of the torch ops, eagerly and through the static-buffer decode step (the CUDA-graph path run
without capture), over prefills that start fresh and chunks that continue a cached context.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config.schema import ConfigError
from appliance.engine.engine import LLMEngine
from appliance.engine.runtime import resolve_fused_kernels
from tests.conftest import default_config
from tests.engine.test_static_decode import run_lengths, uncaptured_static_decode


def engine_for(model_dir: Path, fused: str, *extra: str) -> LLMEngine:
    # A 24-token budget cuts the longer prompts into chunks: the second chunk attends to the cache
    # the first one wrote (through rope_write_kv when fused).
    return LLMEngine(default_config(f"model.path={model_dir}", "engine.num_kv_blocks=64",
                                    "engine.max_num_batched_tokens=24", f"engine.fused_kernels={fused}", *extra))


@pytest.fixture(scope="module")
def torch_tokens(tiny_model_dir: Path) -> dict[str, list[int]]:
    eng = engine_for(tiny_model_dir, "torch")
    assert eng.runner.fused_kernels == "torch"
    assert not eng.runner.model.layers[0].mlp.fused
    return run_lengths(eng)


def test_fused_kernels_give_the_torch_tokens(tiny_model_dir: Path, torch_tokens: dict) -> None:
    # Prefill chunks run eagerly; decode steps go through the static-buffer step a captured graph
    # runs (padding rows writing their K/V to the pad block). One engine covers both (the
    # interpreter is slow: one run only).
    eng = engine_for(tiny_model_dir, "triton", "engine.attention_backend=triton")
    layer = eng.runner.model.layers[0]
    assert layer.input_layernorm.fused and layer.self_attn.fused and layer.mlp.fused and eng.runner.model.norm.fused
    _, used = uncaptured_static_decode(eng)
    assert run_lengths(eng) == torch_tokens
    assert used and max(used) == 5


def test_fused_kernels_setting() -> None:
    import torch

    assert resolve_fused_kernels("auto", torch.device("cpu")) == "torch"
    assert resolve_fused_kernels("torch", torch.device("cpu")) == "torch"
    assert resolve_fused_kernels("triton", torch.device("cpu")) == "triton"  # the interpreter is on in tests
    assert default_config().engine.fused_kernels == "auto"
    with pytest.raises(ConfigError, match="engine.fused_kernels"):
        default_config("engine.fused_kernels=on")
