"""What a request asks its output to match: a JSON object, a JSON schema, a regex or an EBNF grammar.

The server builds one from `response_format`, `/generate`'s `json_schema`/`regex` or vLLM's `guided_*`
fields; the engine compiles it off its thread (compiler.py) and masks the row's logits with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_object", "json_schema", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 65536  # bound on a spec's text (docs/structured-outputs.md)


@dataclass(frozen=True)
class GrammarSpec:
    """`value`: the JSON schema as JSON text (json_schema), the regex, the EBNF grammar (root rule
    `root`), or "" (json_object: any JSON object). `param`: the request field it came from, named in
    errors (e.g. "response_format", "guided_json"); not part of the cache key."""

    kind: GrammarKind
    value: str = ""
    param: str = "response_format"

    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (the compiler's cache key)."""
        return (self.kind, self.value)

    def validate(self) -> None:
        """Raise ValueError for a spec that is malformed before compiling (kind, size, JSON text);
        SamplingParams.validate turns it into a RequestError naming `param`."""
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError("the grammar must be a string")
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the grammar is {len(self.value)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("the JSON schema must be an object")
        elif self.kind in ("regex", "ebnf") and not self.value:
            raise ValueError(f"the {self.kind} must not be empty")

    @staticmethod
    def json_schema(schema: object, param: str = "response_format") -> "GrammarSpec":
        """A spec from a schema given as parsed JSON (a dict); key order kept, so equal texts share a
        cache entry."""
        return GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")), param)
