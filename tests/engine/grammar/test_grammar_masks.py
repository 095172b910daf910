"""Grammar masks on the engine end to end, on a tiny random Llama with the default model's tokenizer:
constrained rows match their grammar and end on EOS once it completes; free rows of the same batch
are untouched; logprobs stay the raw model's; padded vocabulary ids are never allowed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from appliance.engine.engine import LLMEngine
from appliance.engine.grammar.mask import TokenMask, apply_mask, apply_mask_reference
from appliance.engine.grammar.spec import GrammarSpec
from appliance.engine.request import RequestError, SamplingParams
from tests.conftest import default_config, make_tiny_model

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "c": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "c"]}
REGEX = r"(yes|no), [0-9]{2}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> LLMEngine:
    # 64 padding ids past the tokenizer's 49152, as models padded to a multiple of 64 have.
    model = make_tiny_model(tmp_path_factory.mktemp("tiny_padded"), default_model_dir, vocab_size=49152 + 64)
    return LLMEngine(default_config(f"model.path={model}", "model.device=cpu", "model.max_model_len=256",
                                    "engine.grammar_threads=1"))


def run(engine: LLMEngine, batch: list[tuple[str, SamplingParams]]) -> dict[str, tuple[list[int], str, str, list]]:
    for i, (prompt, p) in enumerate(batch):
        engine.add_request(str(i), engine.tokenizer.encode(prompt), p)
    res: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            r = res.setdefault(o.request_id, [[], "", None, []])
            r[0] += o.token_ids
            r[1] += o.text
            r[3] += o.logprobs or []
            if o.finished:
                r[2] = o.finish_reason
    return {k: tuple(v) for k, v in res.items()}  # type: ignore[misc]


def test_mixed_batch_constrained_and_free_rows(engine: LLMEngine) -> None:
    free = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.9, seed=7, ignore_eos=True)]
    alone = run(engine, [("Once upon a time", p) for p in free])
    bias_pad = {49152 + 10: 100.0, 49152 + 63: 100.0}  # padding ids pushed up: the mask still wins
    batch = [
        ("Once upon a time", free[0]),
        ("Give JSON", SamplingParams(max_tokens=60, temperature=0.0, grammar=GrammarSpec.json_schema(SCHEMA))),
        ("Once upon a time", free[1]),
        ("Answer", SamplingParams(max_tokens=30, temperature=1.0, seed=3, logit_bias=bias_pad,
                                  grammar=GrammarSpec("regex", REGEX))),
        ("Any JSON", SamplingParams(max_tokens=60, temperature=0.0, presence_penalty=1.0,
                                    grammar=GrammarSpec("json_object"))),
    ]
    out = run(engine, batch)
    assert out["0"][0] == alone["0"][0] and out["2"][0] == alone["1"][0]  # free rows untouched
    jsonschema.validate(json.loads(out["1"][1]), SCHEMA)
    assert out["1"][2] == "stop"  # ended on EOS once the object closed
    assert re.fullmatch(REGEX, out["3"][1]) and out["3"][2] == "stop"
    assert all(t < 49152 for t in out["3"][0])
    if out["4"][2] == "stop":
        assert isinstance(json.loads(out["4"][1]), dict)
    else:  # a random model may write a long object; what it wrote is still a prefix of one
        assert out["4"][1].startswith("{")


def test_logprobs_are_the_raw_models(engine: LLMEngine) -> None:
    """The first token's top logprobs of a constrained row equal a free row's on the same prompt."""
    free = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    constrained = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, grammar=GrammarSpec("regex", "zz+"))
    out = run(engine, [("Hello", free), ("Hello", constrained)])
    assert out["1"][1] == "z" or engine.tokenizer.decode(out["1"][0]).startswith("z")
    assert out["0"][3][0].top == out["1"][3][0].top


def test_ignore_eos_restarts_the_grammar(engine: LLMEngine) -> None:
    """Benchmarks run constrained rows past the grammar's end: it starts again after each EOS."""
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, grammar=GrammarSpec("regex", "(ab|cd)"))
    ids, _, reason, _ = run(engine, [("x", p)])["0"]
    assert reason == "length" and len(ids) == 20
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert re.fullmatch("((ab|cd))+", text), text


def test_bad_grammars_are_request_errors_naming_the_field(engine: LLMEngine) -> None:
    compiler = engine.grammar_compiler()
    for spec in (GrammarSpec("regex", "(", "guided_regex"),
                 GrammarSpec("json_schema", '{"type": "nope"}', "response_format.json_schema.schema"),
                 GrammarSpec("ebnf", "root ::= missing", "guided_grammar")):
        with pytest.raises(RequestError) as e:
            compiler.compile(spec)
        assert e.value.param == spec.param and spec.param in str(e.value)
    with pytest.raises(RequestError) as e:
        SamplingParams(grammar=GrammarSpec("json_schema", "{not json", "guided_json")).validate()
    assert e.value.param == "guided_json"
    assert engine.num_waiting == 0


def test_compiled_grammars_are_cached_and_bounded(engine: LLMEngine) -> None:
    compiler = engine.grammar_compiler()
    size, compiler.cache_size = compiler.cache_size, 2
    try:
        specs = [GrammarSpec("regex", f"a{{{k}}}") for k in range(1, 4)]
        first = compiler.compile(specs[0])
        hits = compiler.hits
        assert compiler.compile(GrammarSpec("regex", "a{1}", "guided_regex")) is first  # param is not in the key
        assert compiler.hits == hits + 1
        compiler.compile(specs[1])
        compiler.compile(specs[2])
        assert not compiler.cached(specs[0]) and compiler.cached(specs[1]) and compiler.cached(specs[2])
    finally:
        compiler.cache_size = size


@pytest.mark.parametrize("rows", [[0], [1, 3], [0, 1, 2, 3]])
def test_apply_mask_matches_its_torch_twin(rows: list[int]) -> None:
    g = torch.Generator().manual_seed(len(rows))
    v = 100  # not a multiple of 32: the last word is partly padding
    bits = torch.randint(-2**31, 2**31 - 1, (4, 4), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, v, generator=g)
    mask = TokenMask(bits, rows, v)
    a, b = logits.clone(), logits.clone()
    apply_mask(a, mask)
    apply_mask_reference(b, mask)
    assert torch.equal(a, b)
    free = [i for i in range(4) if i not in rows]
    assert torch.equal(a[free], logits[free])


def test_a_grammar_without_any_output_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match="admits no output") as e:
        engine.grammar_compiler().compile(GrammarSpec("regex", r"[^\x00-\U0010FFFF]", "guided_regex"))
    assert e.value.param == "guided_regex"


def test_min_tokens_does_not_hold_a_constrained_row_past_its_grammar(engine: LLMEngine) -> None:
    p = SamplingParams(max_tokens=10, min_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "ok"))
    ids, text, reason, _ = run(engine, [("x", p)])["0"]
    assert (text, reason) == ("ok", "stop")
