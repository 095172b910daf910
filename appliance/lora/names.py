"""The one rule for adapter names, checked wherever a name enters: the admin API (through the
registry) and the YAML inventory (config/schema.py).

1..MAX_NAME_CHARS printable characters (`str.isprintable`: no control, bidi, zero-width or unassigned
code points), no surrounding whitespace, no ':' (it separates base and adapter in OpenAI `model`).
Names reach logs, terminals, JSON and Prometheus labels, so nothing may forge a line or hide text.
Pure Python: the config schema imports it.
"""

from __future__ import annotations

from typing import Optional

MAX_NAME_CHARS = 128
# How much of a name (or of anything a client sent) an error message repeats.
SHOWN_CHARS = 64


def name_problem(name: str) -> Optional[str]:
    """Why `name` is not a valid adapter name, or None when it is."""
    if not name:
        return "must not be empty"
    if len(name) > MAX_NAME_CHARS:
        return f"must be at most {MAX_NAME_CHARS} characters, got {len(name)}"
    if name != name.strip():
        return "must not start or end with whitespace"
    if ":" in name:
        return "must not contain ':' (it separates base and adapter in 'model')"
    bad = next((c for c in name if not c.isprintable()), None)
    if bad is not None:
        return f"must hold printable characters only, found U+{ord(bad):04X}"
    return None


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` itself when short, else its first `limit` characters and '...' (e.g. an error's `param`)."""
    return text if len(text) <= limit else text[:limit] + "..."


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` as an error message may repeat it: repr-quoted (control characters escaped) and cut to
    `limit` characters, so a client cannot make the server echo megabytes or forge log lines."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def adapter_key(name: str) -> str:
    """The key path of adapter `name` in config messages: `adapters.<name>`, or `adapters[<repr>]`
    (cut) for a name that breaks the rule, so the message itself stays one short printable line."""
    return f"adapters.{name}" if name_problem(name) is None else f"adapters[{shown(name)}]"
