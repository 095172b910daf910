"""Multi-LoRA in the engine against peft: mixed batches, slot pressure, pinning, unload, reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.engine.engine import LLMEngine
from appliance.engine.request import AdapterNotFoundError, SamplingParams
from tests.conftest import default_config

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
# New tokens where every decode step runs in Triton's interpreter, compared with the oracle's prefix: the
# prefill and two decode steps (a second step reuses the first's buffers; async launches it ahead).
SHORT = 3

# name -> peft LoraConfig kwargs: several ranks, rslora, rank/alpha patterns, different target sets.
ADAPTERS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8rs": dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
    "pattern": dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                    rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 32}),
    "down2": dict(r=2, lora_alpha=64, target_modules=["down_proj"]),
    "mlp6": dict(r=6, lora_alpha=24, target_modules=["gate_proj", "up_proj"]),
}


def make_adapter(base_dir: Path, dest: Path, seed: int, **kw) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw))
    # peft's random init is small next to the tiny model's weights; make every adapter matter.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.normal_(0.0, 0.3)
    model.save_pretrained(dest)
    return dest


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts_ids: list[list[int]],
                new: int = NEW) -> tuple[list[list[int]], list[torch.Tensor]]:
    """`new` greedy tokens and the first step's last-position logits, one prompt at a time, with peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    toks, logits = [], []
    with torch.no_grad():
        for ids in prompts_ids:
            x = torch.tensor([ids])
            logits.append(model(x).logits[0, -1])
            out = model.generate(x, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
            toks.append(out[0, len(ids):].tolist())
    return toks, logits


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_model_dir, root / name, seed=i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def oracle(adapters: dict[str, Path], tiny_model_dir: Path) -> dict[str | None, tuple]:
    from appliance.engine.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    out = {name: peft_greedy(tiny_model_dir, path, ids) for name, path in adapters.items()}
    out[None] = peft_greedy(tiny_model_dir, None, ids)
    return out


def lora_engine(model_dir: Path, root: Path, *overrides: str) -> LLMEngine:
    return LLMEngine(default_config(f"model.path={model_dir}", "engine.num_kv_blocks=128", "lora.enabled=true",
                                    "lora.max_lora_rank=8", f"lora.adapter_roots=[{root}]", *overrides))


def run_mixed(engine: LLMEngine, jobs: list[tuple[str | None, int]], new: int = NEW) -> dict[int, list[int]]:
    """Submit every (adapter name, prompt index) at once; job index -> its first `new` greedy tokens
    (a prefix of the oracle's NEW: greedy decoding does not look ahead)."""
    params = GREEDY if new == NEW else SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for j, (name, p) in enumerate(jobs):
        engine.add_request(str(j), engine.tokenizer.encode(PROMPTS[p]), params, adapter=name)
    res: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            res.setdefault(int(o.request_id), []).extend(o.token_ids)
    assert engine.block_manager.num_used == 0
    return res


def prefill_against_peft(engine: LLMEngine, oracle: dict, jobs: list[tuple[str | None, int]],
                         params: SamplingParams) -> tuple:
    """Submit every (adapter name, prompt index) at once and run the first step, where all of them
    prefill in one batch; each request's last-position logits against peft's. -> (plan, logits)."""
    for j, (name, p) in enumerate(jobs):
        engine.add_request(str(j), engine.tokenizer.encode(PROMPTS[p]), params, adapter=name)
    plan = engine.scheduler.schedule()
    assert len(plan.prefills) == len(jobs)
    logits = engine.runner.execute(plan)
    for j, (name, p) in enumerate(jobs):
        diff = (logits[j] - oracle[name][1][p]).abs().max().item()
        assert diff <= 1e-3, f"{name} prompt {p}: logits differ by {diff}"
    return plan, logits


@pytest.mark.parametrize("backend", ["triton", "csgmv"])
def test_prefill_through_the_triton_gemm_matches_peft(adapters: dict[str, Path], oracle: dict, tiny_model_dir: Path,
                                                     backend: str) -> None:
    """lora.prefill_gemm=triton: every wrapped projection of the prefill step is one lora_gemm launch (the
    shrink in its grid, the delta in its GEMM's epilogue; interpreted on CPU); the step's last-position
    logits against peft's, every adapter and base requests in one batch."""
    root = next(iter(adapters.values())).parent
    engine = lora_engine(tiny_model_dir, root, "lora.max_loras_per_batch=5", f"lora.backend={backend}",
                         "lora.prefill_gemm=triton")
    assert engine.lora.ctx.prefill_gemm == "triton"
    for name, path in adapters.items():
        engine.lora.load(name, str(path))
    jobs = [(name, p) for name in [None, *adapters] for p in range(len(PROMPTS))]
    prefill_against_peft(engine, oracle, jobs, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))


# triton/csgmv: the Triton kernels, in the interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET).
@pytest.mark.parametrize("backend", ["torch", "triton", "csgmv"])
def test_mixed_batch_matches_peft_per_adapter(adapters: dict[str, Path], oracle: dict, tiny_model_dir: Path,
                                              backend: str) -> None:
    root = next(iter(adapters.values())).parent
    engine = lora_engine(tiny_model_dir, root, "lora.max_loras_per_batch=5", f"lora.backend={backend}")
    for name, path in adapters.items():
        engine.lora.load(name, str(path))
    jobs = [(name, p) for name in [None, *adapters] for p in range(len(PROMPTS))]
    # The Triton backends run in the interpreter (~1 s a decode step at 24 rows): SHORT tokens, the
    # prefill plus two decode steps with every adapter in the batch, against peft's prefix.
    new = NEW if backend == "torch" else SHORT
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    # First step: every request prefills in one batch; compare its last-position logits to peft.
    plan, logits = prefill_against_peft(engine, oracle, jobs, params)
    # Then the same batch decodes to the end: greedy tokens against peft's.
    got: dict[int, list[int]] = {}
    for o in engine._postprocess(plan, logits):
        got.setdefault(int(o.request_id), []).extend(o.token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(int(o.request_id), []).extend(o.token_ids)
    assert engine.block_manager.num_used == 0
    for j, (name, p) in enumerate(jobs):
        assert got[j] == oracle[name][0][p][:new], f"{name} prompt {p}"
    if backend == "torch":  # a second round on the warm engine (slots already loaded); cheap on torch only
        assert run_mixed(engine, jobs) == got
    # Adapters really change the output (the test would be vacuous otherwise): every adapter moves
    # the logits, and most change the greedy text.
    moved = {n: (oracle[n][1][0] - oracle[None][1][0]).abs().max().item() for n in adapters}
    assert all(v > 0.05 for v in moved.values()), moved
    assert sum(oracle[n][0] != oracle[None][0] for n in adapters) >= 3


def test_two_slots_one_pinned_four_in_use(adapters: dict[str, Path], oracle: dict, tiny_model_dir: Path) -> None:
    root = next(iter(adapters.values())).parent
    engine = lora_engine(tiny_model_dir, root, "lora.max_loras_per_batch=2", "lora.max_loaded_loras=2")
    names = list(adapters)
    engine.lora.load(names[0], str(adapters[names[0]]), pinned=True)
    for n in names[1:]:
        engine.lora.load(n, str(adapters[n]))
    pinned_slot = engine.lora.pool.lookup(engine.lora.resolve(names[0]))
    jobs = [(n, p) for n in [None, *names] for p in range(2)]
    for j, (name, p) in enumerate(jobs):
        engine.add_request(str(j), engine.tokenizer.encode(PROMPTS[p]), GREEDY, adapter=name)
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        adapters_in_batch = {s.seq.adapter for s in plan.prefills + plan.decodes} - {None}
        assert len(adapters_in_batch) <= 2
        assert engine.lora.pool.lookup(engine.lora.resolve(names[0])) == pinned_slot
        if plan.empty:
            continue
        for o in engine._postprocess(plan, engine.runner.execute(plan)):
            got.setdefault(int(o.request_id), []).extend(o.token_ids)
    for j, (name, p) in enumerate(jobs):
        assert got[j] == oracle[name][0][p], f"{name} prompt {p}"
    assert engine.lora.pool.stats().evictions > 0


def test_unload_waits_for_in_flight_and_reload_in_place(adapters: dict[str, Path], oracle: dict,
                                                        tiny_model_dir: Path) -> None:
    root = next(iter(adapters.values())).parent
    engine = lora_engine(tiny_model_dir, root)
    engine.lora.load("a", str(adapters["qv4"]))
    engine.add_request("r", engine.tokenizer.encode(PROMPTS[0]), GREEDY, adapter="a")
    out: list[int] = sum((o.token_ids for o in engine.step()), [])
    engine.lora.unload("a")
    while engine.has_unfinished():
        for o in engine.step():
            out += o.token_ids
    assert out == oracle["qv4"][0][0]
    from appliance.lora.registry import LoRAStateError

    with pytest.raises(LoRAStateError) as e:
        engine.lora.resolve("a")
    assert e.value.status == 404
    assert not engine.lora.keys  # the retired weights are gone once the request finished

    # In-place reload: a running request finishes on the old weights, later ones get the new.
    engine.lora.load("b", str(adapters["qv4"]))
    engine.add_request("old", engine.tokenizer.encode(PROMPTS[1]), GREEDY, adapter="b")
    res: dict[str, list[int]] = {"old": sum((o.token_ids for o in engine.step()), [])}
    engine.lora.load("b", str(adapters["all8rs"]), inplace=True)
    engine.add_request("new", engine.tokenizer.encode(PROMPTS[1]), GREEDY, adapter="b")
    while engine.has_unfinished():
        for o in engine.step():
            res.setdefault(o.request_id, []).extend(o.token_ids)
    assert res["old"] == oracle["qv4"][0][1]
    assert res["new"] == oracle["all8rs"][0][1]
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("gone", [1, 2], GREEDY, adapter="a")  # unloaded above
    base = engine.model_name
    engine.add_request("prefixed", engine.tokenizer.encode(PROMPTS[1]), GREEDY, adapter=f"{base}:b")
    assert engine.seqs["prefixed"].adapter == engine.lora.resolve("b")
    engine.abort("prefixed")


def test_reload_same_name_while_old_weights_still_in_flight(adapters: dict[str, Path], oracle: dict,
                                                            tiny_model_dir: Path) -> None:
    root = next(iter(adapters.values())).parent
    engine = lora_engine(tiny_model_dir, root)
    engine.lora.load("x", str(adapters["qv4"]), pinned=True)
    engine.add_request("old", engine.tokenizer.encode(PROMPTS[2]), GREEDY, adapter="x")
    res: dict[str, list[int]] = {"old": sum((o.token_ids for o in engine.step()), [])}
    engine.lora.unload("x")
    engine.lora.load("x", str(adapters["down2"]), pinned=True)  # same name, new weights, old still running
    engine.add_request("new", engine.tokenizer.encode(PROMPTS[2]), GREEDY, adapter="x")
    while engine.has_unfinished():
        for o in engine.step():
            res.setdefault(o.request_id, []).extend(o.token_ids)
    assert res["old"] == oracle["qv4"][0][2]
    assert res["new"] == oracle["down2"][0][2]
    assert list(engine.lora.keys) == [engine.lora.current["x"]]  # the old weights left with their request


def config_with_adapters(tmp: Path, adapters_yaml: str, *overrides: str):
    """The repo's config tree plus an `adapters:` block, composed."""
    from appliance.config.compose import compose_config
    from tests.conftest import config_tree

    return compose_config(config_tree(tmp / "configs", "adapters:\n" + adapters_yaml), list(overrides))


def test_adapters_listed_in_config_load_at_start(adapters: dict[str, Path], oracle: dict, tiny_model_dir: Path,
                                                 tmp_path: Path) -> None:
    from appliance.config.schema import ConfigError

    root = next(iter(adapters.values())).parent
    lora = [f"model.path={tiny_model_dir}", "engine.num_kv_blocks=128", "lora.enabled=true", "lora.max_lora_rank=8",
            f"lora.adapter_roots=[{root}]"]
    good = f"  a:\n    path: {adapters['qv4']}\n    pinned: true\n    rank: 4\n    target_modules: [q_proj, v_proj]\n"
    engine = LLMEngine(config_with_adapters(tmp_path / "ok", good, *lora))
    assert engine.lora.registry.get("a").pinned
    assert run_mixed(engine, [("a", 0)])[0] == oracle["qv4"][0][0]
    wrong_rank = f"  a:\n    path: {adapters['qv4']}\n    rank: 8\n"
    with pytest.raises(ConfigError, match=r"adapters\.a\.rank: expected 8, the adapter has rank 4"):
        LLMEngine(config_with_adapters(tmp_path / "rank", wrong_rank, *lora))
    outside = f"  b:\n    path: {root}/../elsewhere\n"
    with pytest.raises(ConfigError, match=r"adapters\.b: .*outside lora.adapter_roots"):
        LLMEngine(config_with_adapters(tmp_path / "outside", outside, *lora))
    with pytest.raises(ConfigError, match="lora.enabled is false"):
        config_with_adapters(tmp_path / "off", good, f"model.path={tiny_model_dir}")
    with pytest.raises(ConfigError, match=r"adapters\.a\.(foo|.*foo)"):
        config_with_adapters(tmp_path / "typo", good + "    foo: 1\n", *lora)


def test_triton_backends_refused_on_cpu_without_interpreter(tiny_model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with Triton's interpreter off, triton/csgmv fail at start with the key path, not mid-request."""
    import kernels.platform
    from appliance.config.schema import ConfigError

    monkeypatch.setattr(kernels.platform, "interpreter_active", lambda: False)
    for backend in ("triton", "csgmv"):
        with pytest.raises(ConfigError, match=r"lora\.backend: '" + backend + "' cannot run here: .*CUDA device"):
            lora_engine(tiny_model_dir, tmp_path, f"lora.backend={backend}", "model.device=cpu")
    assert lora_engine(tiny_model_dir, tmp_path, "lora.backend=torch", "model.device=cpu").lora is not None


def test_decode_side_stream_on_by_default_only_with_cuda(adapters: dict[str, Path], tiny_model_dir: Path) -> None:
    """lora.decode_side_stream: null resolves to off on CPU (on with a CUDA device at tp 1); true asks
    for it anywhere (on CPU: the same kernels in the side-stream order, on one stream)."""
    root = next(iter(adapters.values())).parent
    for value, want in (("null", False), ("true", True), ("false", False)):
        engine = lora_engine(tiny_model_dir, root, "lora.backend=triton", f"lora.decode_side_stream={value}")
        assert engine.lora.ctx.decode_aside is want and engine.lora.ctx.side_stream is None, value


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_static_decode_with_triton_lora_matches_peft(adapters: dict[str, Path], oracle: dict,
                                                     tiny_model_dir: Path, async_on: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-graph decode layout on CPU (engine/cuda_graph.py, not captured): one LoRA segment per
    row, base and padding rows at slot -1, Triton attention and the fused kernels; 6 requests padded
    to 8 rows. Then a base-only batch, which takes the variant without LoRA launches. async: each
    decode step launched before the last one's tokens are read (engine/async_step.py).

    The prefill puts gate_up_proj's expand inside the activation (LoRALinear.forward_deferred +
    kernels/silu_mul_lora.py's tile body). The async run also takes the decode path of a GPU batch too
    small for lora_apply's one-launch kernel (on CPU it would always fuse): shrink then expand per
    projection, and gate_up_proj's expand inside the activation (the one-token body).

    SHORT tokens, not NEW: each step runs every kernel in Triton's interpreter (~2 s with LoRA rows), and
    the prefill plus two decode steps already cover every row kind and async's launch-ahead. Pages
    crossing a KV block boundary in the static layout are tests/engine/test_static_decode.py's."""
    import kernels.silu_mul_lora
    from appliance.lora.backend import policy
    from appliance.engine.cuda_graph import StaticDecode

    deferred: list[int] = []  # the longest segment of each silu_mul_lora call
    if async_on:
        monkeypatch.setattr(policy, "_fuse_pays", lambda pairs, device: False)
    real_silu_mul_lora = kernels.silu_mul_lora.silu_mul_lora
    monkeypatch.setattr(kernels.silu_mul_lora, "silu_mul_lora",
                        lambda *a, **k: (deferred.append(a[3].max_len), real_silu_mul_lora(*a, **k))[1])
    root = next(iter(adapters.values())).parent
    engine = lora_engine(tiny_model_dir, root, "lora.max_loras_per_batch=4", "lora.backend=triton",
                         "engine.attention_backend=triton", "engine.fused_kernels=triton",
                         f"engine.async_scheduling={str(async_on).lower()}")
    names = ["qv4", "all8rs", "pattern"]
    for name in names:
        engine.lora.load(name, str(adapters[name]))
    engine.runner.start_static_decode([8], capture=False)  # with the LoRA manager's context
    sd = engine.runner.static_decode
    assert isinstance(sd, StaticDecode) and sd.lora is engine.lora.ctx
    variants: list[bool] = []
    real_forward = sd._forward
    sd._forward = lambda b, n, with_lora: (variants.append(with_lora), real_forward(b, n, with_lora))[1]  # type: ignore[method-assign]
    jobs = [(None, 0), ("qv4", 1), ("all8rs", 2), ("pattern", 3), ("all8rs", 0), (None, 3)]
    got = run_mixed(engine, jobs, SHORT)
    for j, (name, p) in enumerate(jobs):
        assert got[j] == oracle[name][0][p][:SHORT], f"{name} prompt {p}"
    assert variants and all(variants)  # an adapter row in every decode step
    # gate_up's expand inside the activation: the prefill (tile body) in both runs, decode steps (one-token
    # body) only where lora_apply does not fuse them (the async run)
    assert any(n > 1 for n in deferred) and any(n == 1 for n in deferred) == async_on, deferred
    variants.clear()
    base_jobs = [(None, 1), (None, 2)]
    got = run_mixed(engine, base_jobs, SHORT)
    for j, (_, p) in enumerate(base_jobs):
        assert got[j] == oracle[None][0][p][:SHORT], f"base prompt {p}"
    assert variants and not any(variants)  # base rows only: no LoRA launches


@pytest.mark.parametrize("backend", ["csgmv", "auto"])
def test_static_decode_sorted_layout_sorts_rows_by_slot_and_matches_peft(backend: str, adapters: dict[str, Path],
                                                                        oracle: dict, tiny_model_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Backend csgmv, and auto as it runs on CUDA (triton's per-request segments for the eager steps,
    LoRAConfig.sorted_decode; here the triton backend with the flag set, since auto is torch on a
    CPU), in the CUDA-graph decode layout (not captured, CPU): a size with enough rows per
    slot sorts its rows by slot on the device (kernels/segments.sorted_segments_device, chunks of
    lora.max_chunk_size = 2, so the two all8rs rows share a chunk), base and padding rows in chunks of
    slot -1; the projections run lora_shrink + lora_expand over the chunks, gate_up_proj's expand
    inside the activation (kernels/silu_mul_lora.py's tile body, the slot -1 chunks without a delta).
    6 requests padded to 8 rows, 4 slots (the threshold lowered to 2 rows a slot). The auto case runs
    lora.decode_side_stream's order (shrink, base GEMM, expand), the csgmv case lora_apply's."""
    import appliance.engine.cuda_graph as cg
    import kernels.silu_mul_lora

    monkeypatch.setattr(cg, "SORTED_MIN_ROWS_PER_SLOT", 2)
    in_act: list[bool] = []  # per silu_mul_lora call: the static decode batch's sorted chunks?
    real_silu_mul_lora = kernels.silu_mul_lora.silu_mul_lora
    monkeypatch.setattr(kernels.silu_mul_lora, "silu_mul_lora",
                        lambda *a, **k: (in_act.append(a[3].static_sorted), real_silu_mul_lora(*a, **k))[1])
    built: list[list[int]] = []
    real_build = cg.sorted_segments_device
    monkeypatch.setattr(cg, "sorted_segments_device",
                        lambda rs, S, chunk: (built.append(rs.tolist()), real_build(rs, S, chunk))[1])
    root = next(iter(adapters.values())).parent
    engine = lora_engine(tiny_model_dir, root, "lora.max_loras_per_batch=4",
                         f"lora.backend={'csgmv' if backend == 'csgmv' else 'triton'}",
                         "lora.max_chunk_size=2", "engine.attention_backend=triton",
                         "engine.fused_kernels=triton",
                         # auto: the shrink-aside order GPUs run (on CPU the same kernels, one stream)
                         f"lora.decode_side_stream={str(backend == 'auto').lower()}")
    assert engine.lora.ctx.sorted_decode == (backend == "csgmv")
    if backend == "auto":
        engine.lora.ctx.sorted_decode = True  # what LoRAConfig.sorted_decode gives auto on CUDA
    for name in ["qv4", "all8rs", "pattern"]:
        engine.lora.load(name, str(adapters[name]))
    engine.runner.start_static_decode([8], capture=False)
    assert engine.runner.static_decode.sorted_layout(8) and not engine.runner.static_decode.sorted_layout(4)
    jobs = [(None, 0), ("qv4", 1), ("all8rs", 2), ("pattern", 3), ("all8rs", 0), (None, 3)]
    got = run_mixed(engine, jobs, SHORT)
    for j, (name, p) in enumerate(jobs):
        assert got[j] == oracle[name][0][p][:SHORT], f"{name} prompt {p}"
    assert built and all(len(rs) == 8 and rs[6:] == [-1, -1] for rs in built)  # padded rows: no adapter
    assert any(in_act), in_act  # gate_up's expand in the activation on the sorted chunks
    slots = [s for s in built[0] if s >= 0]
    assert len(slots) == 4 and len(set(slots)) == 3  # all8rs's two rows on one slot
