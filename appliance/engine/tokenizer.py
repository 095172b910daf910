"""Tokenizer wrapper and incremental detokenisation.

Byte-level BPE cannot be detokenised one token at a time (multi-byte characters span tokens, spacing
depends on the left neighbour), so we decode a short window with and without the new tokens, emit the
difference, and hold back text ending in U+FFFD until the next token completes it.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Optional, Sequence

# Tokens of left context decoded with each new token; enough for any merge to settle.
_CONTEXT_TOKENS = 6


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        eos: set[int] = set()
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        gen_cfg = Path(path) / "generation_config.json"
        if gen_cfg.is_file():
            import json

            g = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos.update([g] if isinstance(g, int) else (g or []))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = len(self.hf)
        # With no clean-up pass, the Rust decode alone gives transformers' text much faster (two a token).
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._rust_decode = (backend.decode if backend is not None
                             and not getattr(self.hf, "clean_up_tokenization_spaces", False) else None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids that decoding with skip_special_tokens leaves out (added tokens marked special)."""
        ids = {int(i) for i, t in self.hf.added_tokens_decoder.items() if t.special}
        return frozenset(ids | {int(i) for i in self.hf.all_special_ids})

    def special_ids_of(self, texts: Sequence[str]) -> frozenset[int]:
        """The ids of those of `texts` that are one special token each (e.g. `<tool_call>` in Qwen2.5)."""
        out = set()
        for text in texts:
            i = self.hf.convert_tokens_to_ids(text)
            if isinstance(i, int) and i in self.special_token_ids and self.hf.convert_ids_to_tokens(i) == text:
                out.add(i)
        return frozenset(out)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template reads `tools` (else the server writes them into the messages)."""
        t = getattr(self.hf, "chat_template", None) or ""
        return bool(re.search(r"\btools\b", t if isinstance(t, str) else " ".join(t.values())))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            add_special_tokens: bool = False, tools: Optional[list[dict[str, Any]]] = None,
                            continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        """Token ids of `messages` rendered by the model's chat template, by default ready for the reply.
        add_special_tokens is off by default: the template already wrote any BOS it wants.
        `template_kwargs`: extra variables the template reads (vLLM's chat_template_kwargs)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary writes it (e.g. 'Ġthe'), for /tokenize."""
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(ids))]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


class IdsOnlyTokenizer:
    """For a shape-only model dir (model.init=random, no tokenizer files): requests must send token ids,
    and outputs carry token ids with empty text. EOS ids come from config.json."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.has_chat_template = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        from appliance.engine.request import RequestError

        raise RequestError("this model has no tokenizer (a shape-only model dir): send token ids, not text")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    supports_tools = False
    special_token_ids: frozenset[int] = frozenset()

    def special_ids_of(self, texts: Sequence[str]) -> frozenset[int]:
        return frozenset()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            add_special_tokens: bool = False, tools: Optional[list[dict[str, Any]]] = None,
                            continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        return self.encode("")

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return ["" for _ in ids]


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas that are safe to send.
    `skip_special_tokens`: special tokens are left out of the text, except the ids in `keep`."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 keep: frozenset[int] = frozenset()) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        # Left out by hand when some special tokens stay: decoding then keeps every special token.
        self.drop = tokenizer.special_token_ids - keep if skip_special_tokens and keep else frozenset()
        # Start with a little of the prompt as left context so the first token's leading space is right.
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the window decoded as context
        self.read_offset = len(self.ids)  # tokens before this are already emitted as text

    def add(self, token_id: int) -> str:
        """Append one token; return the new text that is final (may be "")."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            # The emitted tokens become the next call's left context.
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """Text held back at the end (an unfinished character is returned as is)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        if self.drop:
            return self.tok.decode([i for i in ids if i not in self.drop], skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=self.skip)


def find_stop(text: str, stops: Sequence[str], start: int) -> Optional[int]:
    """Index in `text` where the first stop string begins, searching matches that end after `start`."""
    best: Optional[int] = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string (hold it back).

    Candidates are found with str.find, so a call costs about the stops' total length, never the text's.
    """
    best = 0
    for s in stops:
        n = min(len(s) - 1, len(text))
        if n <= best:
            continue
        tail = text[len(text) - n:]
        i = tail.find(s[0])
        while i != -1 and n - i > best:
            if s.startswith(tail[i:]):
                best = n - i
                break
            i = tail.find(s[0], i + 1)
    return best
