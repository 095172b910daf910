"""How much device memory the KV cache may take, so that `engine.gpu_memory_utilization` bounds the whole
process: weights, LoRA slot buffers, the largest step's activations, the decode CUDA graphs' pool, and
the KV cache together.

The runner measures (weights, buffers, the activation peak of the largest step and decode graph) and
this pure-Python module decides, so the decision is tested on a fake device's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config.schema import ConfigError
from appliance.models.args import ModelArgs

GIB = 2**30


def weight_bytes(a: ModelArgs, dtype_bytes: int, tp_size: int = 1) -> int:
    """Bytes of one rank's weights: embeddings, every layer's projections and norms, the LM head."""
    h, i = a.hidden_size, a.intermediate_size
    per_layer = h * (a.q_size + 2 * a.kv_size) + a.q_size * h + 3 * h * i  # qkv, o, gate/up/down
    if a.attention_bias:
        per_layer += a.q_size + 2 * a.kv_size
    if a.o_proj_bias:
        per_layer += h
    total = a.num_layers * per_layer // tp_size + a.num_layers * 2 * h + h  # norms stay whole
    total += a.vocab_size * h * (1 if a.tie_word_embeddings else 2)
    return total * dtype_bytes


def lora_buffer_bytes(a: ModelArgs, targets: list[str], slots: int, max_rank: int, dtype_bytes: int,
                      tp_size: int = 1) -> int:
    """The GPU slot buffers (lora/layers.py): A and B of every target projection in every layer, per slot,
    at max_rank (sharded over tp ranks)."""
    per_layer = sum(sum(a.proj_shape(t)) for t in targets)
    return a.num_layers * slots * max_rank * per_layer * dtype_bytes // tp_size


def check_weights_fit(total: int, utilization: float, weights: int, dtype: str) -> None:
    """Refuse before loading a model whose weights alone exceed the budget (the load would OOM)."""
    budget = total * utilization
    if weights > budget:
        raise ConfigError(
            f"engine.gpu_memory_utilization: the model's weights in {dtype} take {weights / GIB:.1f} GiB, "
            f"more than {utilization:g} of the device's {total / GIB:.1f} GiB ({budget / GIB:.1f} GiB); "
            "use a smaller dtype (model.dtype=bfloat16), more GPUs (parallel.tp_size), or a higher "
            "engine.gpu_memory_utilization")


@dataclass(frozen=True)
class KVPlan:
    """The sizing decision and the numbers behind it (logged, and shown in errors)."""

    total: int  # device memory
    utilization: float
    used: int  # in use before the KV cache: weights, LoRA buffers, CUDA context, other processes
    activation_peak: int  # the largest eager step's temporaries, above `used`
    graph_reserve: int  # the decode CUDA graphs' memory pool
    bytes_per_block: int
    num_blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (f"{self.utilization:g} of {self.total / GIB:.1f} GiB = {self.total * self.utilization / GIB:.1f} GiB: "
                f"weights and buffers {self.used / GIB:.1f} GiB, largest step {self.activation_peak / GIB:.2f} GiB, "
                f"decode graphs {self.graph_reserve / GIB:.2f} GiB, KV cache {self.kv_bytes / GIB:.2f} GiB "
                f"({self.num_blocks} blocks)")


def plan_kv_blocks(total: int, free: int, utilization: float, activation_peak: int, graph_reserve: int,
                   bytes_per_block: int, cap: int) -> KVPlan:
    """Blocks that fit in `total * utilization` beside what is in use now (`total - free`), the largest
    step's activations and the graphs' pool; at most `cap` (every sequence at full length)."""
    used = total - free
    budget = total * utilization - used - activation_peak - graph_reserve
    n = min(max(int(budget // bytes_per_block), 0), cap)
    plan = KVPlan(total, utilization, used, activation_peak, graph_reserve, bytes_per_block, n)
    if n < 1:
        raise ConfigError(f"engine.gpu_memory_utilization: no memory left for the KV cache ({plan.describe()}); "
                          "raise engine.gpu_memory_utilization, lower engine.max_num_batched_tokens or "
                          "model.max_model_len, use a smaller model.dtype, or set engine.num_kv_blocks")
    return plan
