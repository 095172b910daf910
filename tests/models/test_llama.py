"""Our Llama-family model against transformers' LlamaForCausalLM on the same weights (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from appliance.models.attention import AttentionMetadata, PrefillSeq
from appliance.models.llama import LlamaModel, ModelArgs, rope_inv_freq
from appliance.models.weights import load_model
from tests.conftest import default_config, make_tiny_model

PROMPT = "List 3 countries and their capitals. The quick brown fox jumps over"


def prefill_logits(model: LlamaModel, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Logits of every position, run through our paged-cache path (optionally in prefill chunks)."""
    a = model.args
    bs, T = 16, ids.shape[0]
    nblk = (T + bs - 1) // bs
    cache = torch.zeros(a.num_layers, 2, nblk, bs, a.num_kv_heads, a.head_dim)
    table = torch.arange(nblk)
    out = []
    chunk = chunk or T
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end), prefills=[PrefillSeq(0, end - start, start, table)],
            num_prefill_tokens=end - start, decode_block_tables=torch.zeros(0, nblk, dtype=torch.long),
            decode_context_lens=torch.zeros(0, dtype=torch.long), decode_max_len=0)
        out.append(model.compute_logits(model(ids[start:end], torch.arange(start, end), cache, meta)))
    return torch.cat(out)


def check_parity(model_dir: Path, tokenizer_ids: list[int]) -> None:
    ours = load_model(model_dir, torch.float32, torch.device("cpu"), 512)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer_ids)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
        got = prefill_logits(ours, ids)
        got_chunked = prefill_logits(ours, ids, chunk=5)
    assert (got - want).abs().max().item() <= 1e-4
    assert (got_chunked - want).abs().max().item() <= 1e-4


def test_default_model_logits_match_transformers(default_model_dir: Path) -> None:
    from appliance.engine.tokenizer import Tokenizer

    check_parity(default_model_dir, Tokenizer(default_model_dir).encode(PROMPT))


def test_tiny_model_with_qkv_bias_untied_matches_transformers(tiny_model_dir: Path) -> None:
    from appliance.engine.tokenizer import Tokenizer

    assert ModelArgs.from_hf_config(__import__("json").loads((tiny_model_dir / "config.json").read_text())).attention_bias
    check_parity(tiny_model_dir, Tokenizer(tiny_model_dir).encode(PROMPT))


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path, default_model_dir: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    d = make_tiny_model(tmp_path, default_model_dir, rope_scaling=scaling, rope_theta=500000.0,
                        head_dim=32, num_attention_heads=4, hidden_size=64)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers import LlamaConfig

    hf_cfg = LlamaConfig.from_pretrained(d)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    args = ModelArgs.from_hf_config(__import__("json").loads((d / "config.json").read_text()))
    assert args.rope_scaling is not None
    torch.testing.assert_close(rope_inv_freq(args), want.float(), rtol=1e-6, atol=0)
    check_parity(d, list(range(3, 120)))


@pytest.mark.parametrize("which", ["default", "tiny"])
def test_greedy_generation_matches_transformers(which: str, default_model_dir: Path, tiny_model_dir: Path) -> None:
    model_dir = default_model_dir if which == "default" else tiny_model_dir
    engine = LLMEngine(default_config(f"model.path={model_dir}", "engine.num_kv_blocks=64"))
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_request("r", ids, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.token_ids
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(ids):].tolist()
    assert got == want


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_llama_family_architectures_match_transformers(arch: str, tmp_path: Path,
                                                             default_model_dir: Path) -> None:
    import shutil

    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from appliance.engine.tokenizer import Tokenizer

    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    torch.manual_seed(0)
    ref = model_cls(cfg_cls(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                            tie_word_embeddings=False))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.08)
    ref.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, tmp_path / f)
    args = ModelArgs.from_hf_config(__import__("json").loads((tmp_path / "config.json").read_text()))
    assert args.attention_bias == (arch == "qwen2") and not args.o_proj_bias
    check_parity(tmp_path, Tokenizer(tmp_path).encode(PROMPT))
