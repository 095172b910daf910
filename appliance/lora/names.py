"""The one rule for adapter names, checked wherever a name enters: the admin API (through the
registry), the YAML inventory (config/schema.py) and nowhere weaker.

A name is 1..MAX_NAME_CHARS characters, every one printable (`str.isprintable`: no control characters
such as newline, CR, NUL or ANSI ESC, no format characters such as the bidi overrides U+202A..U+202E
and U+2066..U+2069 or zero-width ones, no line/paragraph separators, surrogates, private-use or
unassigned code points), without surrounding whitespace and without ':' (it separates base and
adapter in OpenAI `model`, "<base>:<adapter>"). Names reach logs, terminals (`appliance plan`), JSON
answers and Prometheus label values, so anything that could forge a line or hide text is refused.

Pure Python, no torch: the config schema imports it.
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
