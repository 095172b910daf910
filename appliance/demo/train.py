"""Train the demo LoRA adapters (pirate, french) with peft on CPU, one small adapter per style.

Each style is a JSONL file of hand-written pairs, `{"prompt": user question, "answer": styled answer}`,
in data/. A pair is rendered with the base model's own chat template (with its default system prompt,
as the server renders a request without one) and the loss covers only the assistant's tokens and its
closing <|im_end|>, so the adapter learns how to answer, not how to ask, and when to stop.

The result is a plain PEFT dir, `out_dir/<name>/{adapter_config.json, adapter_model.safetensors}`, that
appliance.lora.adapter accepts: r=8 on the attention projections, weights saved as float16 (~1.8 MB).
peft, transformers and torch are imported inside the functions: importing this module needs none of them.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from appliance.config.schema import DEFAULT_MODEL_NAME, ModelConfig

if TYPE_CHECKING:
    import torch

DATA_DIR = Path(__file__).resolve().parent / "data"
ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
STYLES = ("pirate", "french")
# Labels at -100 are ignored by the cross-entropy loss (torch's ignore_index).
IGNORE = -100


@dataclass(frozen=True)
class TrainArgs:
    """The settings the shipped adapters were trained with; the command line overrides steps and seed."""

    rank: int = 8
    alpha: int = 16
    # Attention only: enough to change the style and keeps the file under 2 MB (MLP targets would triple it).
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # 40 steps of 4 pairs: ~2.4 passes over ~67 pairs. Plenty for the pirate tone; the French adapter would
    # gain from more (it is partly off-topic), but a step takes 15-40 s on our shared 2-core CPU.
    steps: int = 40
    batch_size: int = 4
    lr: float = 3e-3
    warmup: int = 4
    seed: int = 0


def load_pairs(name: str, data_dir: Path = DATA_DIR) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of one style, in file order; a malformed line fails with its line number."""
    path = data_dir / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training data for style {name!r} (known: {', '.join(STYLES)})")
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("answer"), str):
            raise ValueError(f"{path}:{n}: expected {{\"prompt\": str, \"answer\": str}}, got {line[:80]!r}")
        pairs.append((row["prompt"], row["answer"]))
    if not pairs:
        raise ValueError(f"{path}: holds no pairs")
    return pairs


def encode_pair(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one chat turn; labels are IGNORE on the prompt and on the trailing newline."""
    user = [{"role": "user", "content": prompt}]
    # Text first, then tokens: the template's result type for tokenize=True differs across transformers versions.
    head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=False)
    if not full.startswith(head):
        raise ValueError("chat template renders the prompt differently with and without the answer")
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    if ids[:len(head_ids)] != head_ids:
        raise ValueError("prompt tokens change when the answer follows; cannot mask the prompt")
    labels = [IGNORE] * len(head_ids) + ids[len(head_ids):]
    # The template ends a turn with "<|im_end|>\n": learn to emit <|im_end|> (the eos), not what follows it.
    end = len(ids)
    while end > len(head_ids) and ids[end - 1] != tokenizer.eos_token_id:
        end -= 1
    labels[end:] = [IGNORE] * (len(ids) - end)
    return ids, labels


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, "torch.Tensor"]:
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [B, T], right-padded
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(examples), width), dtype=torch.long)  # [B, T]
    for row, (x, y) in enumerate(examples):
        ids[row, :len(x)], labels[row, :len(y)], mask[row, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train_adapter(model_dir: Path, out: Path, name: str, args: TrainArgs, log=print) -> Path:
    """Train one style's adapter and save it to `out` (replaced if it exists); returns `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)  # LoRA A's init draws from torch's generator
    rng = random.Random(args.seed)  # batch order
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = [encode_pair(tokenizer, p, a) for p, a in load_pairs(name)]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(args.targets),
                                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    # Linear warmup, then linear decay to 10% of lr: a short run that ends without large last steps.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / args.warmup,
                                                                 1.0 - 0.9 * s / max(1, args.steps - 1)))
    model.train()
    order: list[int] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        if len(order) < args.batch_size:  # epochs of shuffled examples, carried over step boundaries
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        picked, order = order[:args.batch_size], order[args.batch_size:]
        loss = model(**_batch([examples[i] for i in picked], tokenizer.pad_token_id)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == args.steps - 1:
            log(f"[{name}] step {step + 1}/{args.steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")

    for p in params:  # float16 halves the file; appliance.lora.adapter accepts F16 and upcasts on load
        p.data = p.data.to(torch.float16)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    _finish_dir(out)
    return out


def _finish_dir(out: Path) -> None:
    """Make the saved dir shippable: our model name instead of a local path, no peft model card."""
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = DEFAULT_MODEL_NAME
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)  # the card peft writes names the local model path
    stray = sorted(p.name for p in out.iterdir() if p.name not in ("adapter_config.json", "adapter_model.safetensors"))
    if stray:
        raise RuntimeError(f"{out}: unexpected files after save_pretrained: {stray}")


def train_adapters(model_dir: Path, out_dir: Path, names: Sequence[str] = STYLES, steps: int = TrainArgs.steps,
                   seed: int = TrainArgs.seed, log=print) -> list[Path]:
    """Train each named style into `out_dir/<name>/`; returns the adapter dirs."""
    model_dir, out_dir = Path(model_dir).expanduser(), Path(out_dir).expanduser()
    unknown = [n for n in names if not (DATA_DIR / f"{n}.jsonl").is_file()]
    if unknown:
        raise ValueError(f"unknown style(s) {unknown}; data exists for {', '.join(STYLES)}")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: not a model dir (no config.json); run `appliance model prepare`")
    args = TrainArgs(steps=steps, seed=seed)
    return [train_adapter(model_dir, out_dir / n, n, args, log) for n in names]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="appliance demo train-adapters", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=ModelConfig().path, help="base model dir (default: %(default)s)")
    p.add_argument("--out-dir", default=str(ADAPTERS_DIR), help="writes OUT_DIR/<name>/ (default: %(default)s)")
    p.add_argument("--names", nargs="+", default=list(STYLES), choices=list(STYLES), help="styles to train (default: %(default)s)")
    p.add_argument("--steps", type=int, default=TrainArgs.steps, help="optimizer steps per adapter")
    p.add_argument("--seed", type=int, default=TrainArgs.seed)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    for d in train_adapters(Path(a.model_dir), Path(a.out_dir), a.names, a.steps, a.seed):
        print(f"saved {d}")
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
