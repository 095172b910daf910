"""Which part of each weight one tensor-parallel rank holds. Pure Python, no torch.

Megatron's split, applied from outside the model file (like gpt-fast's tp.py):
- column-parallel (output split): q|k|v of qkv_proj by heads, gate|up of gate_up_proj by rows;
- row-parallel (input split): o_proj and down_proj; their partial outputs are summed (all-reduce);
- vocab-parallel: embed_tokens and lm_head by vocabulary rows; logits gathered on rank 0.
KV heads are split when tp_size <= num_kv_heads; beyond that each KV head is replicated on
tp_size / num_kv_heads consecutive ranks, exactly the ranks whose query heads read it.

The same ranges cut the LoRA weights (S-LoRA): a column-parallel projection keeps A whole and takes
B's rows of its output range; a row-parallel one takes A's columns of its input range and B whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config.schema import ConfigError
from appliance.models.args import ModelArgs

# PEFT projection -> how it is split: "out" = rows of the weight (column-parallel), "in" = columns.
SPLIT = {"q_proj": "out", "k_proj": "out", "v_proj": "out", "gate_proj": "out", "up_proj": "out",
         "o_proj": "in", "down_proj": "in"}


@dataclass(frozen=True)
class TPLayout:
    """Rank `rank` of `size` over the model `args` (the full model's shapes)."""

    args: ModelArgs
    rank: int
    size: int

    @classmethod
    def check(cls, args: ModelArgs, size: int) -> None:
        """Refuse a tp_size that does not divide the model, naming the key and the model's numbers."""
        if size == 1:
            return
        a = args
        need = [("query heads (num_attention_heads)", a.num_heads),
                ("intermediate_size", a.intermediate_size), ("vocab_size", a.vocab_size)]
        if size <= a.num_kv_heads:
            need.append(("KV heads (num_key_value_heads)", a.num_kv_heads))
        bad = [f"{what} {n}" for what, n in need if n % size]
        if size > a.num_kv_heads and size % a.num_kv_heads:
            bad.append(f"KV heads (num_key_value_heads) {a.num_kv_heads}: a tp_size above them must be a "
                       "multiple of them (each KV head is then replicated)")
        if bad:
            raise ConfigError(f"parallel.tp_size: {size} does not divide the model's {'; '.join(bad)} "
                              f"(the model has {a.num_heads} query heads, {a.num_kv_heads} KV heads, "
                              f"intermediate_size {a.intermediate_size}, vocab_size {a.vocab_size})")

    @property
    def num_heads(self) -> int:
        return self.args.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.args.num_kv_heads // self.size)

    def kv_head_start(self) -> int:
        """First global KV head of this rank (replicated case: the one its query heads read)."""
        a = self.args
        if self.size <= a.num_kv_heads:
            return self.rank * self.num_kv_heads
        return self.rank * a.num_kv_heads // self.size

    def local_args(self) -> ModelArgs:
        """The shapes this rank's modules have: fewer heads, a slice of the MLP and the vocabulary."""
        from dataclasses import replace

        a = self.args
        return replace(a, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       intermediate_size=a.intermediate_size // self.size, vocab_size=a.vocab_size // self.size)

    def vocab_range(self) -> tuple[int, int]:
        n = self.args.vocab_size // self.size
        return self.rank * n, (self.rank + 1) * n

    def proj_range(self, proj: str) -> tuple[int, int]:
        """[lo, hi) of the split dimension of `proj` (rows for "out" projections, columns for "in")."""
        a = self.args
        d = a.head_dim
        if proj in ("q_proj", "o_proj"):
            return self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d
        if proj in ("k_proj", "v_proj"):
            lo = self.kv_head_start() * d
            return lo, lo + self.num_kv_heads * d
        n = a.intermediate_size // self.size
        return self.rank * n, (self.rank + 1) * n
