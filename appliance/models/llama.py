"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Tokens arrive flattened ([T], several sequences back to back), with their positions and the step's
AttentionMetadata. q/k/v and gate/up are fused into one linear each (`MergedLinear`, which records its
output slices) so LoRA and tensor parallelism can later wrap the linears without touching this file.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.args import ModelArgs
from appliance.models.attention import AttentionMetadata, paged_attention, write_kv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, scale in the model dtype.
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


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
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c = torch.cat([cos, cos], dim=-1)
    s = torch.cat([sin, sin], dim=-1)
    return (xf * c + torch.cat([-x2, x1], dim=-1) * s).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.qkv_proj = MergedLinear(args.hidden_size, {"q": args.q_size, "k": args.kv_size, "v": args.kv_size},
                                     bias=args.attention_bias)
        self.o_proj = nn.Linear(args.q_size, args.hidden_size, bias=args.o_proj_bias)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        a = self.args
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = q.view(T, a.num_heads, a.head_dim)
        k = k.view(T, a.num_kv_heads, a.head_dim)
        v = v.view(T, a.num_kv_heads, a.head_dim)
        q, k = rope(positions, q, k)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(T, a.q_size))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = MergedLinear(args.hidden_size, {"gate": self.inter, "up": self.inter}, bias=False)
        self.down_proj = nn.Linear(self.inter, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab]."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w).float()
