"""Compile a GrammarSpec into xgrammar's token-level automaton, once per distinct spec.

xgrammar (the grammar engine vLLM and SGLang use) turns a JSON schema, regex or EBNF grammar into a
CompiledGrammar over the tokenizer's vocabulary. Compiling takes milliseconds to seconds, so callers
compile off the engine thread (`AsyncEngine.compile_grammar`) and the engine finds the result here.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any, Iterable

from appliance.engine.grammar.spec import GrammarSpec
from appliance.engine.request import RequestError

# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: "; clients need only the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Thread-safe LRU of compiled grammars keyed by `GrammarSpec.key()`, at most `cache_size` kept.

    `vocab_size` is the model's (logits') width, which may exceed the tokenizer's: the padding ids are
    never allowed. `stop_token_ids`: the tokens that end a row once its grammar is complete.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = 256, threads: int = 4) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        stops = sorted(stop_token_ids)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None)
        self.vocab_size = vocab_size
        # xgrammar's own cache is off: ours is bounded by entries and shared with the error path.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=False)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, spec: GrammarSpec) -> Any:
        """The xgrammar CompiledGrammar of `spec`; RequestError naming `spec.param` when it cannot be
        compiled (bad schema, unsupported keyword, bad regex)."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        what = spec.kind.replace("_", " ")
        try:
            compiled = self._compile(spec)
        except RuntimeError as e:
            message = _CPP_PREFIX.sub("", str(e).strip())
            raise RequestError(f"{spec.param}: cannot compile the {what}: {message}", param=spec.param) from None
        if not self._admits_output(compiled):  # e.g. {"anyOf": []}: no first token would be allowed
            raise RequestError(f"{spec.param}: the {what} admits no output", param=spec.param)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec, stop_token_ids: Iterable[int] = ()) -> Any:
        """A fresh GrammarMatcher for one sequence; `stop_token_ids` (the request's own) end it too,
        besides the tokenizer's EOS, once the grammar is complete."""
        extra = sorted(set(stop_token_ids) - set(self.tokenizer_info.stop_token_ids))
        stops = (list(self.tokenizer_info.stop_token_ids) + extra) if extra else None
        return self._xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=stops)

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec.key() in self._cache

    def _admits_output(self, compiled: Any) -> bool:
        bits = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bits, 0)
        return bool(bits.any())

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_object":
            # OpenAI's json_object is an object (xgrammar's builtin JSON grammar takes any value).
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "json_schema":
            # Compact JSON: with free whitespace, small models pad with newlines until max_tokens.
            return c.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        return c.compile_grammar(spec.value, root_rule_name="root")
