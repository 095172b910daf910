"""GPU check of the engine on one CUDA device: parity with transformers, then decode throughput.

The device host cannot download weights and the working tree it receives is capped in size, so this
uses the default model's architecture (SmolLM2-135M config.json) with random weights, and the
default model's tokenizer files (small) from --tokenizer. On CUDA the engine runs its GPU path (Triton
decode attention, CUDA graphs for decode steps); benchmarks/gpu_engine_check.py compares it with eager.

    python benchmarks/gpu_check.py --tokenizer DIR [--batches 1 8 32 64] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from appliance.config.compose import compose_config
from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_CONFIG = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def make_model(dest: Path, tokenizer: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(dest)
    for f in tokenizer.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, dest / f.name)


def engine_for(model_dir: Path, dtype: str, max_seqs: int, *extra: str) -> LLMEngine:
    # The shipped tree serves the demo adapters; this check starts from none and turns LoRA on itself.
    return LLMEngine(compose_config(REPO / "configs", [
        "adapters=[]", "lora.enabled=false", f"model.path={model_dir}", f"model.dtype={dtype}", "model.device=cuda",
        f"engine.max_num_seqs={max_seqs}", "engine.num_kv_blocks=4096", *extra]))


def make_adapters(model_dir: Path, root: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(n):
        torch.manual_seed(100 + i)
        m = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                      init_lora_weights=False))
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.05)
        m.save_pretrained(root / f"a{i}")
        out.append(root / f"a{i}")
    return out


def lora_section(d: Path, prompts: list[list[int]], batches: list[int], new_tokens: int, backend: str) -> None:
    """fp32 mixed-adapter parity with peft on CUDA, then bf16 tokens/s with 0/1/4/8 adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = d / "adapters"
    paths = make_adapters(d, root, 8, 16)
    lora = ["lora.enabled=true", "lora.max_lora_rank=16", "lora.max_loras_per_batch=8", f"lora.adapter_roots=[{root}]",
            f"lora.backend={backend}"]
    eng = engine_for(d, "float32", 64, *lora)
    for i, p in enumerate(paths):
        eng.lora.load(f"a{i}", str(p))
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    jobs = [(i % 4, prompts[i]) for i in range(8)]
    torch.cuda.synchronize()
    for j, (a, ids) in enumerate(jobs):
        eng.add_request(str(j), ids, greedy, adapter=f"a{a}")
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    same = 0
    for a in range(4):
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), paths[a])
        ref = ref.cuda().eval()
        for j, (aj, ids) in enumerate(jobs):
            if aj != a:
                continue
            want = ref.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            same += int(want == got[str(j)])
    print(f"fp32 mixed batch (4 adapters x 2 prompts) vs peft on cuda: {same}/8 identical (16 tokens)")
    del eng
    torch.cuda.empty_cache()
    eng = engine_for(d, "bfloat16", max(batches), *lora)
    for i, p in enumerate(paths):
        eng.lora.load(f"a{i}", str(p))
    keys = [f"a{i}" for i in range(8)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    b = max(batches)
    print(f"\nbf16 LoRA (rank 16, all 7 projections), batch {b}, tokens/s")
    for label, nad in (("base only", 0), ("1 adapter", 1), ("4 distinct", 4), ("8 distinct", 8)):
        keyset = [None] * b if nad == 0 else [keys[i % nad] for i in range(b)]
        run_keys(eng, prompts[:2], keyset[:2], params)  # warm-up, loads the slots
        outs, dt = run_keys(eng, prompts[:b], keyset, params)
        print(f"{label:>11}: {sum(len(v) for v in outs.values()) / dt:8.0f}")


def run_keys(engine: LLMEngine, prompts: list[list[int]], keys: list, params: SamplingParams):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (p, k) in enumerate(zip(prompts, keys)):
        engine.add_request(f"k{i}-{t0}", p, params, adapter=k)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict[str, list[int]], float]:
    return run_keys(engine, prompts, [None] * len(prompts), params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--lora", action="store_true", help="also check multi-LoRA parity and speed")
    ap.add_argument("--skip-base", action="store_true")
    ap.add_argument("--lora-backend", default="torch", choices=["torch", "triton", "csgmv"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        make_model(d, args.tokenizer)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 49000, (args.prompt_len,), generator=gen).tolist() for _ in range(max(args.batches))]
        greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

        if args.lora:
            lora_section(d, prompts, args.batches, args.new_tokens, args.lora_backend)
        if args.skip_base:
            return
        # 1. Parity in float32 on the GPU: greedy tokens of 4 prompts, batched, against transformers.
        eng = engine_for(d, "float32", 64)
        ours, _ = run(eng, prompts[:4], greedy)
        ids_of = sorted(ours, key=lambda k: int(k.split("-")[0][1:]))  # run_keys names them k{i}-{t0}
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
        same = 0
        for i in range(4):
            ids = torch.tensor([prompts[i]], device="cuda")
            want = ref.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
            same += int(want[0, args.prompt_len:].tolist() == ours[ids_of[i]])
        print(f"fp32 greedy parity with transformers on cuda: {same}/4 prompts identical (32 tokens)")
        del eng, ref
        torch.cuda.empty_cache()

        # 2. bf16 throughput: ours vs transformers generate on the same prompts.
        eng = engine_for(d, "bfloat16", max(args.batches))
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        run(eng, prompts[:2], params)  # warm-up
        rows = []
        for b in args.batches:
            outs, dt = run(eng, prompts[:b], params)
            n = sum(len(v) for v in outs.values())
            ids = torch.tensor(prompts[:b], device="cuda")
            hf.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            hdt = time.perf_counter() - t0
            rows.append((b, n / dt, b * args.new_tokens / hdt))
        print(f"\nbf16, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, tokens/s (prefill included)")
        print(f"{'batch':>6} {'appliance':>10} {'transformers':>13}")
        for b, ours_tps, hf_tps in rows:
            print(f"{b:>6} {ours_tps:>10.0f} {hf_tps:>13.0f}")
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
