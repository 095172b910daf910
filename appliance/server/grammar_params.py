"""The request fields that ask for structured output, turned into the engine's GrammarSpec.

OpenAI routes: `response_format` (json_object, json_schema) and vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`; /generate: SGLang's `json_schema`, `regex`, `ebnf` in
`sampling_params`. At most one per request; what is malformed is a 400 naming the field here, and what
does not compile is one from `AsyncEngine.compile_grammar` before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from appliance.engine.grammar.spec import GrammarSpec
from appliance.server.errors import bad_request
from appliance.server.schemas.native import GenerateSamplingParams
from appliance.server.schemas.openai import Sampling

_OPENAI_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_NATIVE_FIELDS = ("json_schema", "regex", "ebnf")
# Regex metacharacters of xgrammar's (ECMAScript-like) dialect, escaped in guided_choice strings.
_REGEX_META = set("\\^$.|?*+()[]{}/")


def openai_grammar(req: Sampling) -> Optional[GrammarSpec]:
    """The grammar of a chat or completion request, None when it asks for free text."""
    name = _only_one(req, _OPENAI_FIELDS, "")
    if name is None:
        return None
    if name == "response_format":
        rf = req.response_format
        assert rf is not None
        if rf.type == "text":
            return None
        if rf.type == "json_object":
            return GrammarSpec("json_object", "", "response_format")
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("'response_format' of type 'json_schema' needs 'json_schema': {'name': ..., "
                              "'schema': {...}}.", "response_format.json_schema")
        return _json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")
    if name == "guided_json":
        return _json_schema(req.guided_json, "guided_json")
    if name == "guided_regex":
        return GrammarSpec("regex", req.guided_regex or "", "guided_regex")
    if name == "guided_choice":
        choices = req.guided_choice or []
        return GrammarSpec("regex", "|".join(_regex_literal(c) for c in choices), "guided_choice")
    return GrammarSpec("ebnf", req.guided_grammar or "", "guided_grammar")


def generate_grammar(sp: GenerateSamplingParams, prefix: str) -> Optional[GrammarSpec]:
    """The grammar of one /generate input; `prefix` names its sampling_params in errors."""
    name = _only_one(sp, _NATIVE_FIELDS, prefix)
    if name is None:
        return None
    if name == "json_schema":
        return _json_schema(sp.json_schema, prefix + "json_schema")
    return GrammarSpec("regex" if name == "regex" else "ebnf", getattr(sp, name), prefix + name)


def _only_one(model: Any, fields: tuple[str, ...], prefix: str) -> Optional[str]:
    sent = [f for f in fields if getattr(model, f) is not None]
    if len(sent) > 1:
        raise bad_request(f"Send at most one of {', '.join(repr(prefix + f) for f in fields)}; got "
                          f"{', '.join(repr(prefix + f) for f in sent)}.", prefix + sent[1])
    return sent[0] if sent else None


def _json_schema(schema: Union[str, dict, bool, None], param: str) -> GrammarSpec:
    """A schema sent as an object or as JSON text (vLLM and SGLang take both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise bad_request(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"'{param}' must be a JSON schema (an object).", param)
    return GrammarSpec.json_schema(schema, param)


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)
