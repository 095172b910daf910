"""Greedy answers of the base model and of each demo adapter to held-out prompts (none is in data/).

`python -m appliance.demo.samples` prints them as the markdown table in docs/demo-adapters.md; the demo
test uses `greedy` to check that an adapter changes what the model says. transformers + peft, no engine:
it shows the adapters themselves are right, whatever the server does with them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from appliance.config.schema import ModelConfig
from appliance.demo.train import ADAPTERS_DIR, STYLES

HELD_OUT = (
    "List 3 countries and their capitals.",
    "How do I boil an egg?",
    "What is the tallest mountain in the world?",
    "Give me a tip for sleeping better.",
    "Why is the sky blue?",
)


def greedy(model, tokenizer, prompt: str, max_new_tokens: int = 60) -> str:
    """The model's greedy answer to one user turn, rendered with its chat template as the server does."""
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]  # [1, T]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def sample_table(model_dir: Path, adapters_dir: Path, names: Sequence[str], prompts: Sequence[str],
                 max_new_tokens: int) -> dict[str, dict[str, str]]:
    """prompt -> {"base" | name: greedy answer}; one base model, the adapters switched in turn."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    table = {p: {"base": greedy(base, tokenizer, p, max_new_tokens)} for p in prompts}
    model = None
    for name in names:
        if model is None:
            model = PeftModel.from_pretrained(base, adapters_dir / name, adapter_name=name).eval()
        else:
            model.load_adapter(adapters_dir / name, adapter_name=name)
        model.set_adapter(name)
        for p in prompts:
            table[p][name] = greedy(model, tokenizer, p, max_new_tokens)
    return table


def to_markdown(table: dict[str, dict[str, str]]) -> str:
    lines = []
    for prompt, answers in table.items():
        lines.append(f"**{prompt}**\n")
        for who, text in answers.items():
            lines.append(f"- {who}: " + text.replace("\n", " ⏎ "))
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=ModelConfig().path)
    p.add_argument("--adapters-dir", default=str(ADAPTERS_DIR))
    p.add_argument("--names", nargs="+", default=list(STYLES))
    p.add_argument("--max-new-tokens", type=int, default=60)
    a = p.parse_args(argv)
    table = sample_table(Path(a.model_dir).expanduser(), Path(a.adapters_dir), a.names, HELD_OUT, a.max_new_tokens)
    print(to_markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
