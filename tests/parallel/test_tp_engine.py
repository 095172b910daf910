"""Tensor parallelism over CPU processes (gloo): greedy tokens identical to tp_size=1 and to peft.

Real ranks: LLMEngine(tp_size=N) in the test process is rank 0 and starts N-1 worker processes, which
read their shards of the same safetensors and adapter files. Base and mixed-adapter batches; adapter
loads, unloads, in-place reloads and pins go through every rank.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest

from appliance.config.schema import ConfigError
from appliance.engine.engine import LLMEngine
from appliance.engine.request import AdapterNotFoundError, SamplingParams
from appliance.lora.adapter import AdapterError
from appliance.lora.registry import LoRAStateError
from tests.conftest import REPO, default_config, make_tiny_model
from tests.lora.test_lora_engine import ADAPTERS, GREEDY, PROMPTS, SHORT, make_adapter, peft_greedy
from tests.server.test_shutdown import free_port

DEMO = REPO / "appliance" / "demo" / "adapters"


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def tp_engine(model_dir: Path, tp: int, *overrides: str) -> LLMEngine:
    return LLMEngine(default_config(f"model.path={model_dir}", "model.device=cpu", "engine.num_kv_blocks=96",
                                    f"parallel.tp_size={tp}", f"parallel.master_port={free_port()}", *overrides))


def generate(engine: LLMEngine, jobs: list[tuple[str | None, int]],
             lengths: Optional[list[int]] = None) -> list[list[int]]:
    """Every (adapter, prompt index) submitted at once, stepped to the end: greedy tokens per job
    (GREEDY's max_tokens, or job j's lengths[j] with EOS ignored)."""
    for j, (name, p) in enumerate(jobs):
        params = GREEDY if lengths is None else SamplingParams(max_tokens=lengths[j], temperature=0.0,
                                                               ignore_eos=True)
        engine.add_request(str(j), engine.tokenizer.encode(PROMPTS[p]), params, adapter=name)
    out: dict[int, list[int]] = {j: [] for j in range(len(jobs))}
    while engine.has_unfinished():
        for o in engine.step():
            out[int(o.request_id)] += o.token_ids
    assert engine.block_manager.num_used == 0
    return [out[j] for j in range(len(jobs))]


def peft_tokens(model_dir: Path, adapters: dict[str | None, Path | None]) -> dict[str | None, list[list[int]]]:
    from appliance.engine.tokenizer import Tokenizer

    ids = [Tokenizer(model_dir).encode(p) for p in PROMPTS]
    return {name: peft_greedy(model_dir, path, ids)[0] for name, path in adapters.items()}


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-adapters")
    names = ("qv4", "all8rs", "pattern", "down2")  # column- and row-parallel targets, patterns, rslora
    return {n: make_adapter(tiny_model_dir, root / n, seed=i, **ADAPTERS[n]) for i, n in enumerate(names)}


def test_tp2_tiny_mixed_adapters_match_tp1_and_peft(tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    root = next(iter(tiny_adapters.values())).parent
    oracle = peft_tokens(tiny_model_dir, {None: None, **tiny_adapters})
    jobs = [(name, p) for name in [None, *tiny_adapters] for p in range(len(PROMPTS))]
    lora = ("lora.enabled=true", "lora.max_lora_rank=8", "lora.max_loras_per_batch=5", f"lora.adapter_roots=[{root}]")
    one = tp_engine(tiny_model_dir, 1, *lora)
    for name, path in tiny_adapters.items():
        one.lora.load(name, str(path))
    want = generate(one, jobs)
    engine = tp_engine(tiny_model_dir, 2, *lora)
    try:
        assert len(children(os.getpid())) >= 1  # rank 1 runs in its own process
        for name, path in tiny_adapters.items():
            engine.lora.load(name, str(path))
        got = generate(engine, jobs)
        assert got == want
        assert got == [oracle[name][p] for name, p in jobs]
        # Admin operations go through every rank: unload, reload in place under a new key, pin.
        engine.lora.unload("qv4")
        with pytest.raises(AdapterNotFoundError):
            engine.add_request("x", [1, 2, 3], GREEDY, adapter="qv4")
        engine.lora.load("down2", str(tiny_adapters["all8rs"]), inplace=True)  # down2 now serves all8rs
        engine.lora.set_pinned("pattern", True)
        again = generate(engine, [("down2", 0), ("pattern", 1), (None, 2), ("all8rs", 3)])
        assert again == [oracle["all8rs"][0], oracle["pattern"][1], oracle[None][2], oracle["all8rs"][3]]
    finally:
        engine.close()
        one.close()


def test_tp2_replicates_a_single_kv_head(tmp_path: Path, default_model_dir: Path) -> None:
    """tp_size 2 over one KV head: both ranks hold it; adapters on k/v too."""
    model = make_tiny_model(tmp_path / "mqa", default_model_dir, num_key_value_heads=1, tie_word_embeddings=True)
    adapter = make_adapter(model, tmp_path / "kv", seed=7, r=4, lora_alpha=8, target_modules=["k_proj", "v_proj", "o_proj"])
    oracle = peft_tokens(model, {None: None, "kv": adapter})
    engine = tp_engine(model, 2, "lora.enabled=true", "lora.max_lora_rank=8", f"lora.adapter_roots=[{tmp_path}]")
    try:
        engine.lora.load("kv", str(adapter), pinned=True)
        jobs = [(name, p) for name in (None, "kv") for p in range(len(PROMPTS))]
        assert generate(engine, jobs) == [oracle[name][p] for name, p in jobs]
    finally:
        engine.close()


def test_tp3_default_model_base_and_demo_adapters_match_tp1_and_peft(default_model_dir: Path) -> None:
    """SmolLM2-135M (9 query / 3 KV heads, intermediate 1536, vocab 49152) over 3 ranks. 6 new tokens
    (the prefill and 5 decode steps over each rank's KV head), not NEW: a step of this model over 3
    processes on a small CPU costs ~0.75 s, and peft's oracle 0.13 s a token per prompt."""
    from appliance.engine.tokenizer import Tokenizer

    new = 6
    adapters = {"pirate": DEMO / "pirate", "french": DEMO / "french"}
    jobs = [(None, 0), ("pirate", 1), ("french", 2), ("pirate", 0), (None, 1), ("french", 0)]
    tok = Tokenizer(default_model_dir)
    oracle = {}  # peft, only for the prompts each adapter gets: (adapter, prompt) -> tokens
    for name in (None, *adapters):
        ps = sorted({p for n, p in jobs if n == name})
        toks = peft_greedy(default_model_dir, adapters.get(name), [tok.encode(PROMPTS[p]) for p in ps], new)[0]
        oracle.update({(name, p): t for p, t in zip(ps, toks)})
    lora = ("lora.enabled=true", f"lora.adapter_roots=[{DEMO}]")
    want = None
    for tp in (1, 3):
        engine = tp_engine(default_model_dir, tp, *lora)
        try:
            for name, path in adapters.items():
                engine.lora.load(name, str(path))
            got = generate(engine, jobs, [new] * len(jobs))
        finally:
            engine.close()
        assert got == [oracle[job] for job in jobs], f"tp_size={tp}"
        want = want or got
        assert got == want


def test_tp_size_that_does_not_divide_the_model_is_refused_before_any_rank_starts(default_model_dir: Path) -> None:
    before = set(children(os.getpid()))
    with pytest.raises(ConfigError, match=r"parallel.tp_size: 2 does not divide .*query heads "
                                          r"\(num_attention_heads\) 9.*9 query heads, 3 KV heads"):
        tp_engine(default_model_dir, 2)
    assert set(children(os.getpid())) == before


def test_tp_refused_adapter_load_changes_nothing_on_any_rank(tiny_model_dir: Path,
                                                              tiny_adapters: dict[str, Path]) -> None:
    """A refused load (pin limit) after every rank read the adapter: the others drop it, and the
    registry, slots and later outputs are as before."""
    root = next(iter(tiny_adapters.values())).parent
    oracle = peft_tokens(tiny_model_dir, {"qv4": tiny_adapters["qv4"]})
    engine = tp_engine(tiny_model_dir, 2, "lora.enabled=true", "lora.max_lora_rank=8",
                       "lora.max_loras_per_batch=2", f"lora.adapter_roots=[{root}]")
    try:
        engine.lora.load("qv4", str(tiny_adapters["qv4"]), pinned=True)
        with pytest.raises(LoRAStateError, match="pinned"):
            engine.lora.load("pattern", str(tiny_adapters["pattern"]), pinned=True)
        with pytest.raises(AdapterError):
            engine.lora.load("bad", str(root / "missing"))
        assert [e.name for e in engine.lora.registry.entries()] == ["qv4"]
        # A file only rank 0 can read (another host's disk): rank 1's read fails, the load is refused
        # with rank 1's error, and rank 1 keeps nothing of it (its later fill finds no such key).
        spec = engine.lora.keys[engine.lora.current["qv4"]].spec
        with pytest.raises(AdapterError, match=r"tensor-parallel rank 1: .*missing"):
            engine.lora.tp.read("ghost@99", replace(spec, path=root / "missing"))
        with pytest.raises(AdapterError, match=r"tensor-parallel rank 1: adapter 'ghost@99' was never read"):
            engine.lora.tp.fill(1, "ghost@99")
        assert generate(engine, [("qv4", p) for p in range(len(PROMPTS))]) == oracle["qv4"]
    finally:
        engine.close()


@pytest.mark.parametrize("backend", ["triton"])  # csgmv shards the same way; its own parity is tests/lora
def test_tp2_lora_kernel_backends_match_peft(tiny_model_dir: Path, tiny_adapters: dict[str, Path],
                                             backend: str) -> None:
    """The Triton kernels (interpreter on CPU) on each rank's shard: row-parallel A slices included; the
    Triton decode attention over each rank's heads too, and the fused kernels (the GPU defaults under
    TP), so each rank's gate_up_proj column shard takes its prefill delta inside the activation
    (kernels/silu_mul_lora.py's tile body; on CPU lora_apply fuses every decode step)."""
    root = next(iter(tiny_adapters.values())).parent
    oracle = peft_tokens(tiny_model_dir, {None: None, "pattern": tiny_adapters["pattern"],
                                          "qv4": tiny_adapters["qv4"]})
    engine = tp_engine(tiny_model_dir, 2, "lora.enabled=true", "lora.max_lora_rank=8", f"lora.backend={backend}",
                       f"lora.adapter_roots=[{root}]", "engine.attention_backend=triton",
                       "engine.fused_kernels=triton")
    try:
        for name in ("pattern", "qv4"):
            engine.lora.load(name, str(tiny_adapters[name]))
        jobs = [("pattern", 0), ("qv4", 1), (None, 2), ("pattern", 3)]
        # SHORT, not NEW, tokens: every step runs the kernels in Triton's interpreter on both ranks; the
        # prefill and 2 decode steps are compared with peft's prefix (greedy never looks ahead).
        got = generate(engine, jobs, [SHORT] * len(jobs))
        assert got == [oracle[name][p][:SHORT] for name, p in jobs]
    finally:
        engine.close()
