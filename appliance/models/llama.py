"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Tokens arrive flattened ([T], several sequences back to back), with their positions and the step's
AttentionMetadata. q/k/v and gate/up are fused into one linear each (`MergedLinear`, which records its
output slices) so LoRA and tensor parallelism can later wrap the linears without touching this file.

The residual stream is carried beside each block's output (layer i returns (h, residual)) so the next
norm adds and normalises in one op. The elementwise ops have two implementations, picked once by
`LlamaModel.use_fused_kernels` (engine.fused_kernels): the torch ops (kernels/reference.py's twins,
the CPU path and the oracle), or one Triton kernel each for residual add + RMSNorm, RoPE + K/V cache
write and SiLU x up (kernels/rms_norm.py, rope_kv.py, silu_mul.py): 4 launches per layer instead of
~40, which was most of a CUDA-graph decode step's small-kernel time.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.args import ModelArgs
from appliance.models.attention import AttentionMetadata, paged_attention, write_kv
from kernels import reference as ref


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # set by LlamaModel.use_fused_kernels

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (a block's output), residual [T, H] or None -> (norm(x + residual), x + residual).
        Normalised in fp32 like the reference implementation, scaled in the model dtype."""
        if self.fused:
            from kernels.rms_norm import rms_norm  # needs triton: only when chosen

            return rms_norm(x, self.weight, self.eps, residual)
        return ref.rms_norm(x, self.weight, self.eps, residual)


class MergedLinear(nn.Linear):
    """A linear whose output is the concatenation of named slices (q|k|v or gate|up)."""

    def __init__(self, in_features: int, slices: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(slices.values()), bias=bias)
        self.slice_sizes = dict(slices)
        offs, o = {}, 0
        for name, n in slices.items():
            offs[name] = (o, o + n)
            o += n
        self.slice_offsets: dict[str, tuple[int, int]] = offs


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3 or linear scaling when configured."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = args.rope_scaling
    if s is None:
        return inv.float()
    rtype = s.get("rope_type", s.get("type"))
    factor = float(s["factor"])
    if rtype == "linear":
        return (inv / factor).float()
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled).float()


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs, max_len: int) -> None:
        super().__init__()
        inv = rope_inv_freq(args)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_len, d/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, h, d], k [T, kvh, d]; rotate-half convention (HF Llama), computed in fp32.
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        return ref.rope_rotate(q, cos, sin), ref.rope_rotate(k, cos, sin)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.qkv_proj = MergedLinear(args.hidden_size, {"q": args.q_size, "k": args.kv_size, "v": args.kv_size},
                                     bias=args.attention_bias)
        self.o_proj = nn.Linear(args.q_size, args.hidden_size, bias=args.o_proj_bias)
        self.scale = args.head_dim ** -0.5
        self.fused = False  # set by LlamaModel.use_fused_kernels

    def qkv_rope(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> qkv [T, q | k | v] with q and k rotated in place; k and v stored in their cache
        slots [T] (prefill attention reads the fresh K/V from qkv)."""
        a = self.args
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.fused:
            from kernels.rope_kv import rope_write_kv  # needs triton: only when chosen

            rope_write_kv(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, slot_mapping,
                          a.num_heads, a.num_kv_heads)
            return qkv
        q, k, v = self.split_heads(qkv)
        q_rot, k_rot = rope(positions, q, k)
        q.copy_(q_rot)  # back into qkv: both paths hand the same rotated qkv on
        k.copy_(k_rot)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return qkv

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, q | k | v] -> views q [T, h, d], k and v [T, kvh, d]."""
        a = self.args
        T = qkv.shape[0]
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        return (q.view(T, a.num_heads, a.head_dim), k.view(T, a.num_kv_heads, a.head_dim),
                v.view(T, a.num_kv_heads, a.head_dim))

    def attend(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Rotated qkv [T, q | k | v] (K/V already cached) -> attention output [T, q_size]."""
        q, k, v = self.split_heads(qkv)
        return paged_attention(q, k, v, k_cache, v_cache, meta, self.scale).reshape(qkv.shape[0], self.args.q_size)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """The module call is the output projection [T, q_size] -> [T, H]: the row-parallel linear
        whose output tensor parallelism all-reduces with a forward hook (parallel/shard.py)."""
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = MergedLinear(args.hidden_size, {"gate": self.inter, "up": self.inter}, bias=False)
        self.down_proj = nn.Linear(self.inter, args.hidden_size, bias=False)
        self.fused = False  # set by LlamaModel.use_fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from kernels.silu_mul import silu_mul  # needs triton: only when chosen

            # A LoRA-wrapped gate_up_proj (appliance/lora/layers.py) may leave its delta's expand to
            # the activation: one kernel adds it and applies silu x up (kernels/silu_mul_lora.py).
            deferred = getattr(self.gate_up_proj, "forward_deferred", None)
            if deferred is not None:
                gate_up, later = deferred(x)
                if later is not None:
                    from kernels.silu_mul_lora import silu_mul_lora

                    return self.down_proj(silu_mul_lora(gate_up, *later))
            else:
                gate_up = self.gate_up_proj(x)
            return self.down_proj(silu_mul(gate_up))
        return self.down_proj(ref.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    # The layer in two halves around attention, so the piecewise CUDA graphs (engine/piecewise.py) can
    # capture everything but attention; LlamaModel.forward runs the same halves eagerly.
    def before_attention(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                         rope: RotaryEmbedding, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous block's output [T, H] (the embeddings for layer 0, residual None);
        residual: the stream before that block. -> (rotated qkv [T, q | k | v] with K/V cached, the
        stream before this layer)."""
        h, residual = self.input_layernorm(x, residual)
        return self.self_attn.qkv_rope(h, positions, rope, k_cache, v_cache, slot_mapping), residual

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o: attention output [T, q_size]. Returns this layer's MLP output and the stream before it:
        the stream after this layer is their sum, added by the next norm."""
        h, residual = self.post_attention_layernorm(self.self_attn(o), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, max_len: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rope = RotaryEmbedding(args, max_len)
        if args.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [layers, 2, blocks, block_size, kvh, d] -> hidden [T, H]."""
        x = self.embed_tokens(input_ids)
        residual: Optional[torch.Tensor] = None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            qkv, residual = layer.before_attention(x, residual, positions, self.rope, k_cache, v_cache,
                                                   meta.slot_mapping)
            x, residual = layer.after_attention(layer.self_attn.attend(qkv, k_cache, v_cache, meta), residual)
        return self.norm(x, residual)[0]

    def use_fused_kernels(self, on: bool) -> None:
        """engine.fused_kernels resolved: the Triton kernels (True) or the torch ops for the norms,
        RoPE + K/V write and SiLU x up of every layer."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.fused = on

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] in the model's dtype. Not upcast here: greedy rows take the
        argmax as they are (exact: the upcast is monotonic), and the sampler upcasts only the rows it
        samples (a float32 copy of the whole [batch, vocab] is a measurable share of a decode step)."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w)
