"""engine.attention_backend triton with engine.prefill_attention_kernel runs every prefill chunk of a step through one prefill kernel launch
(kernels/prefill_attention.py, the interpreter on CPU): greedy tokens equal backend torch's over fresh
prompts, prefix-cache hits (many chunks over a cached context in one step) and chunked prefill."""

from __future__ import annotations

from pathlib import Path

from appliance.engine.engine import LLMEngine
from appliance.engine.request import SamplingParams
from tests.conftest import default_config

SYSTEM = list(range(200, 237))  # 37 tokens: 2 full blocks of 16 cached, then 5 (a context off the block grid)
PROMPTS = [SYSTEM + [300 + i, 301 + i, 7 * i + 1] for i in range(4)] + [list(range(500, 530))]
NEW = 4


def tokens(model_dir: Path, backend: str) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of one prompt, then of the rest in one wave (the system prompt's blocks hit, the
    30-token prompt is cut in chunks by the 48-token budget); and the cache hits per admission."""
    eng = LLMEngine(default_config(f"model.path={model_dir}", "model.device=cpu", "model.max_model_len=256",
                                   "engine.kv_block_size=16", "engine.num_kv_blocks=64",
                                   "engine.max_num_batched_tokens=48", f"engine.attention_backend={backend}",
                                   "engine.prefill_attention_kernel=true"))
    assert eng.runner.attention_backend == backend and eng.runner.prefill_kernel == (backend == "triton")
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for wave in ([0], [1, 2, 3, 4]):
        for p in wave:
            eng.add_request(f"r{p}", PROMPTS[p], params)
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
    return [out[f"r{p}"] for p in range(len(PROMPTS))], [h for _, _, h in eng.stats.take().prefix_cache_lookups]


def test_prefill_kernel_gives_the_torch_tokens_over_cache_hits_and_chunks(tiny_model_dir: Path) -> None:
    want, hits_torch = tokens(tiny_model_dir, "torch")
    got, hits_triton = tokens(tiny_model_dir, "triton")
    assert hits_triton == hits_torch and hits_triton.count(32) == 3  # the wave's three system-prompt hits
    assert got == want
