"""The shipped demo adapters: servable as they are (inspect_adapter, safetensors only, small), and they change
what the default model says. No training here; the training code is covered by its data and masking checks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appliance.config.schema import DEFAULT_MODEL_NAME, LORA_TARGETS
from appliance.demo.samples import HELD_OUT, greedy
from appliance.demo.train import ADAPTERS_DIR, IGNORE, STYLES, encode_pair, load_pairs
from appliance.lora.adapter import inspect_adapter, load_adapter_weights
from appliance.models.llama import ModelArgs
from appliance.models.weights import read_hf_config
from tests.conftest import REPO, default_config

MAX_BYTES = 3 * 1024 * 1024
# Words a French answer of a few sentences nearly always has; a pirate or English answer has almost none.
FRENCH = {"le", "la", "les", "de", "des", "du", "un", "une", "et", "est", "sont", "pour", "avec", "dans", "vous",
          "en", "il", "elle", "qui", "que", "au", "aux", "sur", "très", "plus", "c'", "l'", "d'"}
PIRATE = {"arr", "matey", "ye", "aye", "ahoy", "hearty", "yer", "o'", "be", "shiver", "yo"}
PROMPT = HELD_OUT[4]  # "Why is the sky blue?"


def words(text: str) -> list[str]:
    return re.findall(r"[a-zàâçéèêëîïôûùüÿœ]+'?", text.lower())


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def answers(default_model_dir: Path, tokenizer) -> dict[str, str]:
    """Greedy answer to PROMPT from the base model and from each adapter (peft, float32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    out = {"base": greedy(base, tokenizer, PROMPT, max_new_tokens=30)}
    for name in STYLES:
        model = PeftModel.from_pretrained(base, ADAPTERS_DIR / name).eval()
        out[name] = greedy(model, tokenizer, PROMPT, max_new_tokens=30)
        base = model.unload()  # the bare base model back, without this adapter's layers
    return out


@pytest.mark.parametrize("name", STYLES)
def test_shipped_adapter_is_servable(name: str, default_model_dir: Path) -> None:
    d = ADAPTERS_DIR / name
    files = sorted(p.name for p in d.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"], files
    assert all((d / f).stat().st_size <= MAX_BYTES for f in files)
    lora = default_config().lora
    args = ModelArgs.from_hf_config(read_hf_config(default_model_dir))
    spec = inspect_adapter(d, lora, args)
    assert spec.rank <= 16 and set(spec.target_modules) <= set(LORA_TARGETS)
    assert spec.base_model_name == DEFAULT_MODEL_NAME  # the served model's name, not a local path
    weights = load_adapter_weights(spec, torch.float32, lora, args)
    assert len(weights) == len(spec.module_ranks) and all(torch.isfinite(b).all() for _, b in weights.values())


@pytest.mark.parametrize("name", STYLES)
def test_training_data(name: str, tokenizer) -> None:
    pairs = load_pairs(name)
    assert 40 <= len(pairs) <= 80
    assert len({p for p, _ in pairs}) == len(pairs)
    assert not set(HELD_OUT) & {p for p, _ in pairs}  # the samples in docs are held out
    ids, labels = encode_pair(tokenizer, *pairs[0])
    kept = [t for t in labels if t != IGNORE]
    # Loss on the answer and its closing <|im_end|>, nothing of the prompt and not the newline after it.
    assert kept[-1] == tokenizer.eos_token_id and labels[-1] == IGNORE
    assert tokenizer.decode(kept[:-1]).strip() == pairs[0][1]


def test_train_module_imports_without_peft() -> None:
    code = "import sys; sys.modules['peft'] = None; import appliance.demo.train, appliance.demo.samples"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_adapters_change_the_answer(answers: dict[str, str]) -> None:
    assert answers["pirate"] != answers["base"] and answers["french"] != answers["base"], answers
    assert len(set(words(answers["pirate"])) & PIRATE) >= 2, answers["pirate"]
    assert len(set(words(answers["french"])) & FRENCH) >= 3, answers["french"]
    assert len(set(words(answers["base"])) & FRENCH) < 3, answers["base"]  # the check can tell them apart
