"""Generated tokens' logprobs in the three response shapes: OpenAI chat, OpenAI completions, SGLang.

The engine gives one `TokenLogprob` per generated token (engine/request.py). A token's text is its own
decode (special tokens kept); a token that holds part of a UTF-8 character decodes to U+FFFD, and its
`bytes` are those of that text, not the raw byte (docs/sampling.md).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from appliance.engine.request import TokenLogprob


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _text(tok: Decoder, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _entry(tok: Decoder, token_id: int, logprob: float) -> dict[str, Any]:
    t = _text(tok, token_id)
    return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8"))}


def chat(tok: Decoder, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or chunk): {"content": [...], "refusal": null}."""
    content = []
    for lp in lps:
        e = _entry(tok, lp.token_id, lp.logprob)
        e["top_logprobs"] = [_entry(tok, t, v) for t, v in lp.top]
        content.append(e)
    return {"content": content, "refusal": None}


def completion(tok: Decoder, lps: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`choices[i].logprobs` of a legacy completion (or chunk); `offset`: characters of the completion's
    text before these tokens (text_offset counts from the completion's start)."""
    tokens, offsets = [], []
    for lp in lps:
        t = _text(tok, lp.token_id)
        offsets.append(offset)
        offset += len(t)
        tokens.append(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_text(tok, t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def completion_chars(tok: Decoder, lps: Sequence[TokenLogprob]) -> int:
    """How far `completion`'s text_offset moves over `lps` (for the next chunk's offset)."""
    return sum(len(_text(tok, lp.token_id)) for lp in lps)


def generate(tok: Optional[Decoder], lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """/generate meta_info fields (SGLang): output_token_logprobs [[logprob, id, text]] and
    output_top_logprobs [[[logprob, id, text], ...]] (top_logprobs_num of them); text is null unless a
    decoder is given (return_text_in_logprobs)."""
    def triple(t: int, v: float) -> list[Any]:
        return [v, t, None if tok is None else _text(tok, t)]

    return {"output_token_logprobs": [triple(lp.token_id, lp.logprob) for lp in lps],
            "output_top_logprobs": [[triple(t, v) for t, v in lp.top] for lp in lps]}


class Streamed(Protocol):
    """What `take` reads and advances on a choice (server/protocol.Choice)."""

    logprobs: Optional[list[TokenLogprob]]
    logprobs_sent: int
    logprob_chars: int


def take(choice: Streamed, tok: Decoder, shape: str) -> Optional[dict[str, Any]]:
    """The logprobs of the choice's tokens not sent yet, in `shape` ("chat" or "completion"), for the
    chunk about to go out; None when the request did not ask. Tokens whose text is still held back
    (a possible stop string) go with the next chunk that carries text."""
    if choice.logprobs is None:
        return None
    new = choice.logprobs[choice.logprobs_sent:]
    choice.logprobs_sent = len(choice.logprobs)
    if shape == "chat":
        return chat(tok, new)
    out = completion(tok, new, choice.logprob_chars)
    choice.logprob_chars += sum(len(t) for t in out["tokens"])
    return out
