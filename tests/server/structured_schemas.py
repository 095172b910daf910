"""The JSON schemas of the structured-output suite: nested objects, arrays, enums, numbers with bounds,
anyOf, strings with patterns. Each is bounded (maxLength, maxItems, integer ranges) so a small model's
answer fits a short max_tokens."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "boolean": {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}},
              "required": ["kind", "x"]},
    "int_bounds": {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["score"]},
    "number_bounds": {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60}}, "required": ["temperature"]},
    "exclusive_bounds": {"type": "object", "properties": {
        "p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}, "required": ["p"]},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": NAME, "city": NAME}, "required": ["name", "city"]}},
        "required": ["person"]},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    "array_ints": {"type": "object", "properties": {
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 1, "maxItems": 3}}, "required": ["values"]},
    "array_strings": {"type": "object", "properties": {
        "countries": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}}, "required": ["countries"]},
    "array_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "minItems": 1,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "ok": {"type": "boolean"}}, "required": ["id", "ok"]}}},
                      "required": ["items"]},
    "top_array": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    "pattern_date": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]},
    "pattern_code": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                     "required": ["code"]},
    "anyof_types": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}},
        "required": ["value"]},
    "anyof_objects": {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"radius": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["radius"]},
        {"type": "object", "properties": {"side": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["side"]}]}}, "required": ["shape"]},
    "nullable": {"type": "object", "properties": {"nickname": {"anyOf": [NAME, {"type": "null"}]}},
                 "required": ["nickname"]},
    "defs_ref": {"type": "object", "$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}, "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
        "required": ["start", "end"]},
    "mixed": {"type": "object", "properties": {
        "title": NAME, "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 2},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5}, "public": {"type": "boolean"}},
        "required": ["title", "tags", "rating", "public"]},
    "classification": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["sentiment", "confidence"]},
    "string_enum_top": {"enum": ["yes", "no"]},
}
