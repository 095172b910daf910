"""model.init=random: a shape-only dir (config.json alone) builds, runs on token ids, and is the same
model transformers gets from the same random_weights stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from appliance.config.schema import ConfigError
from appliance.engine.engine import LLMEngine
from appliance.engine.request import RequestError, SamplingParams
from tests.conftest import REPO, default_config

TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_theta=10000.0, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=[2, 3],
            hidden_act="silu")


def shape_dir(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(TINY))
    return dest


def test_random_init_engine_matches_transformers(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from appliance.models.llama import ModelArgs
    from appliance.models.weights import random_weights

    d = shape_dir(tmp_path / "shape")
    eng = LLMEngine(default_config(f"model.path={d}", "model.init=random", "model.source=null",
                                   "model.device=cpu", "model.dtype=float32", "model.max_model_len=128"))
    assert eng.tokenizer.eos_token_ids == {2, 3}
    prompt = list(range(5, 21))
    eng.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ours: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            ours += o.token_ids
            assert o.text == ""  # ids only
    hf = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    sd = hf.state_dict()
    args = ModelArgs.from_hf_config(TINY)
    with torch.no_grad():
        for key, t in random_weights(args, 0.1, 0, torch.device("cpu")):
            sd[key].copy_(t)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == want
    with pytest.raises(RequestError, match="no tokenizer"):
        eng.tokenizer.encode("hello")


def test_random_init_is_seeded(tmp_path: Path) -> None:
    from appliance.models.weights import random_model

    d = shape_dir(tmp_path / "shape")
    a = random_model(d, torch.float32, torch.device("cpu"), 64, seed=1)
    b = random_model(d, torch.float32, torch.device("cpu"), 64, seed=1)
    c = random_model(d, torch.float32, torch.device("cpu"), 64, seed=2)
    wa, wb, wc = (m.layers[0].self_attn.qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert 0.08 < float(wa.detach().std()) < 0.12  # initializer_range 0.1


def test_model_init_checked() -> None:
    with pytest.raises(ConfigError, match="model.init"):
        default_config("model.init=zeros")


def test_llama3_8b_shape_config_composes() -> None:
    from appliance.models.llama import ModelArgs
    from appliance.models.weights import read_hf_config

    cfg = default_config("model=llama3-8b-shape")
    assert cfg.model.init == "random"
    args = ModelArgs.from_hf_config(read_hf_config(cfg.model.path))
    assert (args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.intermediate_size,
            args.vocab_size, args.head_dim) == (4096, 32, 32, 8, 14336, 128256, 128)
    assert args.rope_scaling["rope_type"] == "llama3" and not args.tie_word_embeddings
    assert Path(cfg.model.path).is_relative_to(REPO / "appliance")
