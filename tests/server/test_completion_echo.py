"""`echo` on /v1/completions (as vLLM): each choice's text opens with its prompt's text, streamed and not,
for string and token-id prompts and n samples; with logprobs (prompt logprobs) a 400."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import ServerThread

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tiny_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def texts(client: openai.OpenAI, **kw) -> tuple[list[str], list[str]]:
    """Each choice's text, whole and as its streamed pieces joined."""
    plain = client.completions.create(model=MODEL, max_tokens=5, temperature=0, **kw)
    joined = [""] * len(plain.choices)
    for chunk in client.completions.create(model=MODEL, max_tokens=5, temperature=0, stream=True, **kw):
        for c in chunk.choices:
            joined[c.index] += c.text
    return [c.text for c in plain.choices], joined


@pytest.mark.parametrize("prompt", ["Once upon a time", ["Hello", "Good day"]])
def test_echo_prefixes_the_prompt(client: openai.OpenAI, prompt) -> None:
    without, _ = texts(client, prompt=prompt, n=2, extra_body={"ignore_eos": True})
    with_echo, streamed = texts(client, prompt=prompt, n=2, echo=True, extra_body={"ignore_eos": True})
    prompts = [prompt] if isinstance(prompt, str) else prompt
    want = [prompts[i // 2] + t for i, t in enumerate(without)]
    assert with_echo == want and streamed == want


def test_echo_of_token_ids_is_their_text(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    ids = tiny_server.engine.tokenizer.encode("The capital of France", add_special_tokens=False)
    without, _ = texts(client, prompt=ids, extra_body={"ignore_eos": True})
    with_echo, streamed = texts(client, prompt=ids, echo=True, extra_body={"ignore_eos": True})
    assert with_echo == streamed == ["The capital of France" + without[0]]


def test_echo_with_logprobs_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, echo=True, logprobs=1)
    assert e.value.response.json()["error"]["param"] == "echo"
