"""Incremental detokenisation against the tokenizer's full decode, multi-byte characters included."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, partial_stop_len

TEXTS = [
    "Hello world, this is plain ASCII text.",
    "Ünïcödé: naïve café, Straße, 東京タワー, 🚀🌍 emojis and 👩‍👩‍👧 families.",
    "  leading spaces\nnew lines\ttabs and   runs  ",
]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Say:")
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add(t) for t in ids]
    pieces.append(d.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_decode_is_transformers_decode(tok: Tokenizer) -> None:
    """decode() calls the Rust tokenizer directly when transformers would add nothing to it."""
    assert tok._rust_decode is not None  # SmolLM2: a fast tokenizer without clean-up
    chat = tok.apply_chat_template([{"role": "user", "content": TEXTS[1]}])
    for ids in [tok.encode(t) for t in TEXTS] + [chat, chat[3:9], list(range(0, 40)), [tok.vocab_size - 1]]:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_stop_helpers() -> None:
    assert find_stop("abc STOP def", ["STOP"], 0) == 4
    assert find_stop("abc STOP def", ["STOP"], 9) is None
    assert find_stop("abc STOP", ["STOP"], 6) == 4  # match straddles what was already searched
    assert partial_stop_len("hello ST", ["STOP"]) == 2
    assert partial_stop_len("hello", ["STOP"]) == 0


def _partial_stop_len_oracle(text: str, stops: list[str]) -> int:
    return max([n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if s.startswith(text[-n:])],
               default=0)


def test_partial_stop_len_matches_its_definition() -> None:
    """The tail-window search (candidates at the stop's first character) against the definition, on
    small alphabets where tails and prefixes overlap often."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
        assert partial_stop_len(text, stops) == _partial_stop_len_oracle(text, stops), (text, stops)


def test_kept_special_tokens_stay_while_others_are_skipped(tool_tag_model_dir: Path) -> None:
    """Tool-call tags that are special tokens reach the text when kept; other special tokens do not."""
    tok = Tokenizer(tool_tag_model_dir)
    tags = ("<tool_call>", "</tool_call>")
    keep = tok.special_ids_of(tags)
    assert len(keep) == 2 and keep <= tok.special_token_ids
    assert tok.special_ids_of(("hello", "<no_such_token>")) == frozenset()
    body = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(body, add_special_tokens=False) + tok.encode("<|im_start|>", add_special_tokens=False)
    assert keep <= set(ids)

    def stream(**kw: object) -> str:
        d = IncrementalDetokenizer(tok, tok.encode("Say:"), **kw)
        return "".join([d.add(t) for t in ids] + [d.flush()])

    assert stream(keep=keep) == body
    assert stream() == tok.decode(ids) == body.replace(tags[0], "").replace(tags[1], "")  # the bug it fixes
    assert stream(skip_special_tokens=False) == body + "<|im_start|>"
