"""What every request model shares: strict JSON types, one validation call that turns pydantic's errors
into the OpenAI error shape (a 400 naming the field), and the bookkeeping of unknown fields.

Strict mode: a JSON value must already have the field's type (no "1" -> 1, no 1.0 -> 1, no true -> 1);
an integer is accepted where a number is. JSON null counts as absent (OpenAI clients send explicit nulls).
"""

from __future__ import annotations

import functools
import typing
from typing import Any, Callable, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationError, ValidatorFunctionWrapHandler
from pydantic import WrapValidator
from pydantic_core import PydanticCustomError

from appliance.lora.names import cut
from appliance.server.errors import ApiError, bad_request, unknown_fields

M = TypeVar("M", bound=BaseModel)

_OWN = "appliance"  # the error type of the messages written here (phrased "must ...")


class Closed(BaseModel):
    """A body of our own API (/generate, admin): an unknown key is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")


class Open(BaseModel):
    """An OpenAI body: unknown keys are kept in `model_extra`, then warned about or refused
    (server.strict_fields: `extra_fields`, `unknown_field_error`)."""

    model_config = ConfigDict(strict=True, extra="allow")


def one_message(message: str) -> WrapValidator:
    """Replace the errors of a union of shapes (which name every member) by one message."""

    def wrap(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(_OWN, message) from None

    return WrapValidator(wrap)


def array_or_object(one: Any, many: Any) -> Any:
    """`one | list[many]`, told apart by the JSON type, so an error names the field inside the
    member the value is (`sampling_params[1].top_p`), not every member of the union."""

    def pick(v: Any) -> str:
        return _ARRAY if isinstance(v, list) else _OBJECT

    return typing.Annotated[Union[typing.Annotated[one, Tag(_OBJECT)], typing.Annotated[many, Tag(_ARRAY)]],
                            Discriminator(pick)]


# The union tags pydantic puts into an error's loc; no declared field has these names.
_OBJECT, _ARRAY = "<object>", "<array>"
_TAGS = {_OBJECT, _ARRAY}


def validate(cls: type[M], body: dict[str, Any], where: str) -> M:
    """`cls.model_validate(body)`; the first problem as an ApiError 400 naming its field.
    `where` names the route in the unknown-key message of a Closed body."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise to_api_error(cls, e.errors(include_url=False), where) from None


_TYPES = {"bool_type": "a boolean", "int_type": "an integer", "float_type": "a number",
          "string_type": "a string", "list_type": "an array", "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object", "none_required": "null"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}


def to_api_error(cls: type[BaseModel], errors: list[Any], where: str) -> ApiError:
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:  # the last step is the client's key, whatever it is
        loc = _steps(unknown[0]["loc"][:-1]) + unknown[0]["loc"][-1:]
        params = [param_of(loc[:-1] + e["loc"][-1:]) or "" for e in unknown
                  if _steps(e["loc"][:-1]) == loc[:-1]]
        owner = _model_at(cls, loc[:-1])
        known = set(owner.model_fields) if owner is not None else set()
        return unknown_fields(params, known, where if len(loc) == 1 else f"'{param_of(loc[:-1])}'")
    e = errors[0]
    steps = _steps(e["loc"])
    param = param_of(steps)
    kind = e["type"]
    if param is None:  # the body itself
        return bad_request(f"The request body: {e['msg']}.")
    if kind == "missing":
        expected = _expected(cls, steps)
        return bad_request(f"Missing required field '{param}'" + (f"; '{param}' must be {expected}." if expected
                                                                 else "."), param)
    if kind == _OWN:
        return bad_request(f"'{param}' {e['msg']}", param)
    if kind in _TYPES:
        return bad_request(f"'{param}' must be {_TYPES[kind]}, got {json_type(e.get('input'))}.", param)
    if kind in _BOUNDS and isinstance(e.get("input"), (int, float)):
        op, key = _BOUNDS[kind]
        return bad_request(f"'{param}' must be {op} {e['ctx'][key]}, got {cut(repr(e['input']), 40)}.", param)
    if kind == "string_too_short" and e.get("ctx", {}).get("min_length") == 1:
        return bad_request(f"'{param}' must be a non-empty string.", param)
    if kind == "too_short" and e.get("ctx", {}).get("min_length") == 1:
        return bad_request(f"'{param}' must not be empty.", param)
    return bad_request(f"'{param}': {e['msg']}.", param)


def _expected(cls: type[BaseModel], steps: tuple) -> Optional[str]:
    """What a missing scalar field must be ("true or false"), for its message; None otherwise."""
    owner = _model_at(cls, steps[:-1])
    if owner is None or not isinstance(steps[-1], str) or steps[-1] not in owner.model_fields:
        return None
    return {bool: "true or false", str: "a string", int: "an integer"}.get(owner.model_fields[steps[-1]].annotation)


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _steps(loc: tuple) -> tuple:
    return tuple(s for s in loc if isinstance(s, int) or s not in _TAGS)


def param_of(steps: tuple) -> Optional[str]:
    """`messages[0].content` for ('messages', 0, 'content'); None for the body itself. Keys are cut,
    so an unknown megabyte key does not come back whole."""
    out = ""
    for s in steps:
        out += f"[{s}]" if isinstance(s, int) else f".{cut(str(s))}"
    return out.lstrip(".") or None


def _model_at(cls: type[BaseModel], steps: tuple) -> Optional[type[BaseModel]]:
    """The model class that holds the fields at `steps` below `cls` (for the known-key list)."""
    cur: Optional[type[BaseModel]] = cls
    for s in steps:
        if isinstance(s, int):
            continue
        if cur is None or s not in cur.model_fields:
            return None
        cur = _inner_model(cur.model_fields[s].annotation)
    return cur


def _inner_model(t: Any) -> Optional[type[BaseModel]]:
    if isinstance(t, type) and issubclass(t, BaseModel):
        return t
    for a in typing.get_args(t):
        found = _inner_model(a)
        if found is not None:
            return found
    return None


def extra_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The unknown keys of an Open model and of the Open models inside it, as params (cut). Walks only
    the fields the client sent that can hold a model (the hot path: one pass per request)."""
    out = [prefix + (param_of((k,)) or "") for k in (model.model_extra or {})]
    nested = _nested_fields(type(model))
    for name in model.model_fields_set:
        if name not in nested:
            continue
        v = getattr(model, name)
        items = v if isinstance(v, list) else [v]
        for i, x in enumerate(items):
            if isinstance(x, Open):
                out += extra_fields(x, f"{prefix}{name}[{i}]." if isinstance(v, list) else f"{prefix}{name}.")
    return out


@functools.cache
def _nested_fields(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(n for n, f in cls.model_fields.items() if _inner_model(f.annotation) is not None)


def refuse_unsupported(model: BaseModel, table: dict[str, Callable[[Any], bool]], prefix: str = "") -> None:
    """400 for a known OpenAI/vLLM field this server does not implement, set to anything but what
    `table[name]` accepts (its default): never silently ignored."""
    sent = model.model_fields_set
    if sent.isdisjoint(table):
        return
    for name, accepted in table.items():
        v = getattr(model, name) if name in sent else None
        if v is not None and not accepted(v):
            raise bad_request(f"'{prefix}{name}' is not supported by this server.", prefix + name)


def unknown_field_error(params: list[str]) -> ApiError:
    """server.strict_fields: 400 naming the first unknown field (and how many there are)."""
    more = f" (+{len(params) - 1} more)" if len(params) > 1 else ""
    return bad_request(f"Unknown field '{params[0]}'{more}; this server refuses unknown fields "
                       "(server.strict_fields is true).", params[0])
