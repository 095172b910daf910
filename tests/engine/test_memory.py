"""KV cache sizing against a fake device: gpu_memory_utilization bounds weights, LoRA buffers, the largest
step's activations, the graphs' pool and the KV cache together, and a model that cannot fit is named
with its numbers. The byte counts are checked against real models and real LoRA buffers."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from appliance.config.schema import ConfigError
from appliance.engine.memory import GIB, check_weights_fit, lora_buffer_bytes, plan_kv_blocks, weight_bytes
from appliance.models.args import ModelArgs, read_hf_config
from tests.conftest import REPO, default_config

LLAMA_8B = ModelArgs.from_hf_config(read_hf_config(REPO / "appliance" / "models" / "shapes" / "llama-3.1-8b"))
H200 = 150_110_978_048  # bytes torch.cuda.mem_get_info reports as total on an H200


def test_weight_bytes_match_real_models(tiny_model_dir: Path) -> None:
    assert weight_bytes(LLAMA_8B, 1) == 8_030_261_248  # Llama-3.1-8B's published parameter count
    assert weight_bytes(LLAMA_8B, 2, tp_size=2) < weight_bytes(LLAMA_8B, 2)
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    assert weight_bytes(ModelArgs.from_hf_config(read_hf_config(tiny_model_dir)), 4) == 4 * params


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_lora_buffer_bytes_match_the_slot_buffers(tiny_model_dir: Path) -> None:
    from appliance.engine.engine import LLMEngine

    cfg = default_config(f"model.path={tiny_model_dir}", "model.device=cpu", "lora.enabled=true",
                         "lora.max_loras_per_batch=3", "lora.max_lora_rank=8")
    engine = LLMEngine.from_config(cfg)
    real = sum(t.numel() * t.element_size() for m in engine.runner.model.modules()
               for name, t in vars(m).items() if name in ("A", "B") and hasattr(t, "numel"))
    args = ModelArgs.from_hf_config(read_hf_config(tiny_model_dir))
    assert real > 0 and lora_buffer_bytes(args, list(cfg.lora.resolved_targets()), 3, 8, 4) == real


def test_float32_8b_fits_and_the_whole_process_stays_in_budget() -> None:
    weights = weight_bytes(LLAMA_8B, 4)
    check_weights_fit(H200, 0.85, weights, "float32")  # 29.9 GiB of weights: fine
    free = H200 - weights - 2 * GIB  # after loading: weights, CUDA context, LoRA buffers
    per_block = 2 * 32 * 16 * 8 * 128 * 4  # k and v, layers, block size, KV heads, head dim, fp32
    plan = plan_kv_blocks(H200, free, 0.85, activation_peak=9 * GIB, graph_reserve=GIB // 2,
                          bytes_per_block=per_block, cap=10**9)
    assert plan.used + plan.activation_peak + plan.graph_reserve + plan.kv_bytes <= 0.85 * H200
    assert 0.85 * H200 - (plan.used + plan.activation_peak + plan.graph_reserve + plan.kv_bytes) < per_block
    assert "largest step 9.00 GiB" in plan.describe()


def test_kv_cache_is_capped_at_what_every_sequence_needs() -> None:
    plan = plan_kv_blocks(H200, H200 - 20 * GIB, 0.85, GIB, 0, 1 << 20, cap=4096)
    assert plan.num_blocks == 4096


def test_weights_that_cannot_fit_are_named_with_numbers() -> None:
    seventy_b = weight_bytes(LLAMA_8B, 4) * 9  # about 70B parameters in float32
    with pytest.raises(ConfigError) as e:
        check_weights_fit(H200, 0.85, seventy_b, "float32")
    msg = str(e.value)
    assert "engine.gpu_memory_utilization" in msg and "269.2 GiB" in msg and "139.8 GiB" in msg
    assert "model.dtype=bfloat16" in msg and "parallel.tp_size" in msg


def test_no_room_for_the_kv_cache_names_every_part() -> None:
    with pytest.raises(ConfigError) as e:
        plan_kv_blocks(H200, H200 - 110 * GIB, 0.85, activation_peak=9 * GIB, graph_reserve=GIB,
                       bytes_per_block=1 << 20, cap=100)
    msg = str(e.value)
    for part in ("0.85 of 139.8 GiB", "weights and buffers 110.0 GiB", "largest step 9.00 GiB",
                 "decode graphs 1.00 GiB", "engine.num_kv_blocks"):
        assert part in msg, part
