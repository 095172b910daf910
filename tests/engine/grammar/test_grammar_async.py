"""Constrained and penalised rows under async scheduling (engine.py `_step_async`), on CPU.

With async scheduling a decode step whose sampling reads the tokens so far launches its forward,
reads the step before, fills the grammar masks and then samples. Every request must get exactly the
tokens, text and finish reason of the synchronous engine, in batches mixing constrained rows (JSON
schema, regex, json_object; greedy and seeded), free rows, penalties, min_tokens and LoRA adapters;
outputs validate; a grammar that completes mid-batch ends its row cleanly while the others go on;
an abort in flight drops the row's token and frees its blocks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from appliance.engine.engine import LLMEngine
from appliance.engine.grammar.spec import GrammarSpec
from appliance.engine.request import SamplingParams
from tests.conftest import default_config
from tests.engine.test_static_decode import uncaptured_static_decode

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "c": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "c"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{2}"
SHORT = r"(ok|no)"  # completes after a token or two: its row ends while the others decode

Job = tuple[str, SamplingParams, "str | None"]  # prompt, params, adapter


def engine_for(model_dir: Path, async_on: bool, *overrides: str) -> LLMEngine:
    eng = LLMEngine(default_config(f"model.path={model_dir}", "engine.num_kv_blocks=96", "model.max_model_len=256",
                                   "engine.grammar_threads=1", f"engine.async_scheduling={str(async_on).lower()}",
                                   *overrides))
    uncaptured_static_decode(eng)
    assert eng.async_scheduling is async_on
    return eng


def run(eng: LLMEngine, jobs: list[Job], abort: str | None = None) -> tuple[dict, int]:
    """id -> (ids, text, finish); and the number of step calls that left a step with a constrained row
    in flight. `abort`: that request is aborted at the first call that leaves its token in flight."""
    for i, (prompt, p, adapter) in enumerate(jobs):
        eng.add_request(str(i), eng.tokenizer.encode(prompt), p, adapter=adapter)
    res: dict[str, list] = {}
    constrained_in_flight = 0
    while eng.has_unfinished():
        for o in eng.step():
            r = res.setdefault(o.request_id, [[], "", ""])
            r[0] += o.token_ids
            r[1] += o.text
            r[2] = o.finish_reason or ""
        launched = eng._inflight
        if launched is not None and any(q.matcher is not None for q in launched.sampling):
            constrained_in_flight += 1
            if abort is not None and abort in eng.seqs and eng.seqs[abort].num_pending == 1:
                eng.abort(abort)
                abort = None
    assert eng.block_manager.num_used == 0 and not eng.scheduler.running and eng._inflight is None
    return {k: tuple(v) for k, v in res.items()}, constrained_in_flight


def mixed_jobs() -> list[Job]:
    json_spec = GrammarSpec.json_schema(SCHEMA)
    return [
        ("Once upon a time", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), None),
        ("Give JSON", SamplingParams(max_tokens=60, temperature=0.0, grammar=json_spec), None),
        ("Once upon a time", SamplingParams(max_tokens=9, temperature=0.9, seed=7, ignore_eos=True), None),
        ("Answer", SamplingParams(max_tokens=30, temperature=1.0, seed=3, grammar=GrammarSpec("regex", REGEX)), None),
        ("Say", SamplingParams(max_tokens=20, temperature=0.0, grammar=GrammarSpec("regex", SHORT)), None),
        ("Any JSON", SamplingParams(max_tokens=40, temperature=0.0, presence_penalty=1.0,
                                    grammar=GrammarSpec("json_object")), None),
        ("Water boils at", SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=1.5,
                                          repetition_penalty=1.3, min_tokens=6), None),
        ("Repeat", SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True,
                                  grammar=GrammarSpec("regex", "(ab|cd)")), None),
    ]


def check_outputs(got: dict) -> None:
    """What each constrained row wrote validates (JSON schema, regex), and it ended on its grammar's EOS."""
    jsonschema.validate(json.loads(got["1"][1]), SCHEMA)
    assert got["1"][2] == "stop"
    assert re.fullmatch(REGEX, got["3"][1]) and got["3"][2] == "stop"
    assert re.fullmatch(SHORT, got["4"][1]) and got["4"][2] == "stop"
    assert got["5"][1].startswith("{")
    if got["5"][2] == "stop":
        assert isinstance(json.loads(got["5"][1]), dict)
    assert len(got["6"][0]) >= 6  # min_tokens held EOS back
    assert got["7"][2] == "length" and len(got["7"][0]) == 14  # ignore_eos: the grammar restarts
    assert re.fullmatch("((ab|cd))+", got["7"][1]), got["7"][1]


@pytest.fixture(scope="module")
def sync_mixed(tiny_model_dir: Path) -> dict:
    got, in_flight = run(engine_for(tiny_model_dir, False), mixed_jobs())
    assert in_flight == 0
    return got


def test_constrained_and_penalised_rows_keep_async_scheduling_and_the_sync_tokens(tiny_model_dir: Path,
                                                                                  sync_mixed: dict) -> None:
    check_outputs(sync_mixed)
    got, in_flight = run(engine_for(tiny_model_dir, True), mixed_jobs())
    assert got == sync_mixed
    assert in_flight >= 10  # constrained steps were left in flight: they ran async


def test_abort_of_a_constrained_row_in_flight(tiny_model_dir: Path, sync_mixed: dict) -> None:
    """The aborted row's token in flight is dropped; the others get the sync tokens."""
    got, _ = run(engine_for(tiny_model_dir, True), mixed_jobs(), abort="1")
    assert "1" not in got or not got["1"][2]  # no finish: aborted rows get no final output
    assert {k: v for k, v in got.items() if k != "1"} == {k: v for k, v in sync_mixed.items() if k != "1"}


def test_constrained_rows_on_adapters_match_sync(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Constrained and free rows on two adapters and the base model in one static decode batch
    (triton LoRA kernels, interpreted: short grammars)."""
    from tests.lora.test_lora_engine import make_adapter

    root = tmp_path_factory.mktemp("grammar_adapters")
    for i, name in enumerate(["a1", "a2"]):
        make_adapter(tiny_model_dir, root / name, seed=i, r=4, target_modules=["q_proj", "v_proj"])
    lora = ("lora.enabled=true", "lora.max_lora_rank=8", f"lora.adapter_roots=[{root}]", "lora.max_loras_per_batch=2",
            "lora.backend=triton", "engine.attention_backend=triton")

    def jobs() -> list[Job]:
        return [("Say", SamplingParams(max_tokens=6, temperature=0.0, grammar=GrammarSpec("regex", SHORT)), "a1"),
                ("Answer", SamplingParams(max_tokens=12, temperature=0.0, grammar=GrammarSpec("regex", REGEX)), "a2"),
                ("Once upon a time", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), "a1"),
                ("Answer", SamplingParams(max_tokens=12, temperature=0.8, seed=11,
                                          grammar=GrammarSpec("regex", REGEX)), None)]

    def go(async_on: bool) -> tuple[dict, int]:
        eng = engine_for(tiny_model_dir, async_on, *lora)
        for name in ["a1", "a2"]:
            eng.lora.load(name, str(root / name))  # type: ignore[union-attr]
        eng.runner.start_static_decode([1, 2, 4], capture=False)  # with the LoRA manager's context
        return run(eng, jobs())

    want, _ = go(False)
    got, in_flight = go(True)
    assert got == want and in_flight >= 2
    assert re.fullmatch(SHORT, got["0"][1]) and got["0"][2] == "stop"
    for k in ("1", "3"):
        assert re.fullmatch(REGEX, got[k][1]) and got[k][2] == "stop"
