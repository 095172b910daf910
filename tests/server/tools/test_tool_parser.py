"""The tool-call parser on fixed model text: whole answers pinned exactly, and every way of cutting the same
text into stream deltas gives the same content and calls, with no markup in the content."""

from __future__ import annotations

import json

import pytest

from appliance.server.tools.parser import CLOSE, OPEN, Delta, ToolCallParser, parse

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TWO_CALLS = (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "a \\"}\\" b"}}\n'
             '</tool_call>')


def stream(text: str, cuts: list[int], forced: bool = False) -> tuple[list[Delta], ToolCallParser]:
    p = ToolCallParser(forced)
    bounds = [0, *cuts, len(text)]
    deltas = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    return [d for d in deltas if d], p


def merged(deltas: list[Delta]) -> tuple[str, list[dict]]:
    """What a client rebuilds from the deltas: the content, and each call's id, name and arguments."""
    content, calls = "", []
    for d in deltas:
        content += d.content
        for c in d.calls:
            if c.id is not None:
                assert c.index == len(calls), "a call's first delta carries the next index"
                calls.append({"id": c.id, "name": c.name, "arguments": ""})
            assert c.index < len(calls)
            calls[c.index]["arguments"] += c.arguments
    return content, calls


def test_hermes_blocks_exactly() -> None:
    content, calls = parse(TWO_CALLS)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", WEATHER), ("get_time", '{"tz": "Europe/Paris", "fmt": "a \\"}\\" b"}')]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls) and calls[0].id != calls[1].id
    assert json.loads(calls[1].arguments)["fmt"] == 'a "}" b'


@pytest.mark.parametrize("text, content, calls", [
    ("Paris is the capital of France.", "Paris is the capital of France.", []),
    ("  two spaces kept \n", "  two spaces kept \n", []),  # a plain answer keeps its text exactly
    ('{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),  # bare call
    ('\n[{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"b": [1, 2]}}]', None,
     [("f", "{}"), ("g", '{"b": [1, 2]}')]),  # an array of them; "parameters" as Llama writes it
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is no call stays content
    ("[1] first point", "[1] first point", []),
    (f'{OPEN}{{"arguments": {{"x": 1}}, "name": "f"}}{CLOSE}', None, [("f", '{"x": 1}')]),  # keys reordered
    (f'{OPEN}{{"name": "f", "arguments": "{{\\"x\\": 1}}"}}{CLOSE}', None, [("f", '{"x": 1}')]),  # string args
    (f"a {OPEN}not json{CLOSE} b", f"a {OPEN}not json{CLOSE} b", []),  # a malformed block stays content
    (f'{OPEN}{{"name": 3, "arguments": {{}}}}{CLOSE} x', f'{OPEN}{{"name": 3, "arguments": {{}}}}{CLOSE} x', []),
    (f'{OPEN}{{"name": "f", "arguments": {{"a": 1}}}}', None, [("f", '{"a": 1}')]),  # end tag left out
    (f'{OPEN}{{"name": "f", "arguments": {{"a": 1}}}}{CLOSE}\n\nDone.', "Done.", [("f", '{"a": 1}')]),
    (f'x {OPEN}{{"name": "f", "arguments": {{"a": [1, {{"b": "c"', "x", [("f", '{"a": [1, {"b": "c"')]),  # cut
    ("ends with <tool_ca", "ends with <tool_ca", []),
    (f"ends with {OPEN}", f"ends with {OPEN}", []),
    ("", None, []),
])
def test_whole_answers(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls


def test_forced_output_streams_each_call() -> None:
    text = '[{"name": "f", "arguments": {"a": "x"}}, {"name": "g", "arguments": {}}]'
    deltas, p = stream(text, list(range(1, len(text))), forced=True)
    assert merged(deltas) == ("", [{"id": p.calls[0].id, "name": "f", "arguments": '{"a": "x"}'},
                                   {"id": p.calls[1].id, "name": "g", "arguments": "{}"}])
    # the header goes out as soon as the arguments open, before the object is complete
    first = next(i for i, d in enumerate(deltas) if d.calls)
    assert deltas[first].calls[0].name == "f" and deltas[first].calls[0].arguments == "{"


@pytest.mark.parametrize("text", [TWO_CALLS, f'Hi {OPEN}oops{CLOSE} there', '{"name": "f", "arguments": {}}',
                                  f'{OPEN}{{"arguments": {{}}, "name": "f"}}{CLOSE}\nand text'])
def test_every_cut_streams_the_same_answer(text: str) -> None:
    """Markup split across deltas at any one or two points (and one char at a time) never leaks."""
    want_content, want_calls = parse(text)
    cuttings = [[i] for i in range(1, len(text))] + [[i, j] for i in range(1, len(text), 7)
                                                      for j in range(i + 1, len(text), 5)]
    for cuts in [*cuttings, list(range(1, len(text)))]:
        deltas, p = stream(text, cuts)
        content, calls = merged(deltas)
        assert content == (want_content or ""), cuts
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in want_calls], cuts
        assert [c["id"] for c in calls] == [c.id for c in p.calls]
        if want_calls:
            assert "tool_call" not in content


def test_arguments_stream_before_the_call_ends() -> None:
    p = ToolCallParser()
    assert p.feed("Checking.\n<tool_") == Delta(content="Checking.")
    d = p.feed('call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, "get_weather", '{"ci')] and not d.content
    d = p.feed('ty": "Paris"}}\n</tool')
    assert [(c.index, c.id, c.arguments) for c in d.calls] == [(0, None, 'ty": "Paris"}')]
    assert not p.feed("_call>\n") and not p.finish()
