"""JSON schemas `appliance bench --decode-json-schema` puts on every decode row: built-in ones by name,
or a schema file. No torch here (the CLI's parser imports the options)."""

from __future__ import annotations

import json
from pathlib import Path

# "record": an extraction-style object (strings, an enum, bounded numbers, an array, a nested object).
BUILTIN: dict[str, dict] = {
    "record": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["person", "place", "thing"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                     "required": ["lat", "lon"]}},
        "required": ["name", "kind", "score", "tags", "location"]},
    "flat": {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 32},
                                              "confident": {"type": "boolean"}},
             "required": ["answer", "confident"]},
}


def load_schema(name_or_path: str) -> dict:
    """A built-in schema by name, else the JSON file at that path; ValueError when neither."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"{name_or_path!r} is neither a built-in schema ({', '.join(BUILTIN)}) nor a file")
    try:
        schema = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{path} does not hold a JSON schema object")
    return schema
