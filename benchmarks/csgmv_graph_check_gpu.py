"""GPU check (issue 6, rounds 8-9): lora.backend csgmv (or auto) with CUDA graphs (the slot-sorted decode
layout at sizes with >= 4 rows a slot; with auto also the shrink on the side stream and gate_up_proj's
expand inside the activation over the sorted chunks) gives the eager engine's greedy tokens (fp32,
torch ops), 12 requests on 4 adapters + base. The SmolLM2-135M architecture with random weights
(gpu_engine_check.py's helpers); H200: 12/12 (csgmv, round 8).

    python3 benchmarks/csgmv_graph_check_gpu.py TOKENIZER_DIR [BACKEND, default csgmv]
"""
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_engine_check as g  # noqa: E402

tok = Path(sys.argv[1])
backend = sys.argv[2] if len(sys.argv) > 2 else "csgmv"
with tempfile.TemporaryDirectory() as td:
    d, prompts = g.small_model(td, tok, 1)
    lens = [4 + (i * 7) % 29 for i in range(12)]
    adapters = g.rank8_adapters(Path(td) / "adapters", d)
    keys = g.adapter_keys(list(adapters))
    toks, sorted_sizes = [], None
    for extra in ((), ("engine.enforce_eager=true", "engine.fused_kernels=torch")):
        eng = g.lora_engine(d, adapters, *extra, backend=backend)
        sd = eng.runner.static_decode
        if sd is not None:
            sorted_sizes = [b for b in sd.sizes if sd.sorted_layout(b)]
        toks.append(g.generate(eng, prompts[:12], lens, keys))
        del eng
        torch.cuda.empty_cache()
    same = sum(toks[0][k] == toks[1][k] for k in toks[1])
    print(f"{backend}, graphs (sorted layout at sizes {sorted_sizes}) + fused vs eager + torch ops, fp32 greedy: "
          f"{same}/12 identical ({sum(lens)} tokens)")
