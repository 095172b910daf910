"""PEFT's module-name patterns (rank_pattern / alpha_pattern keys, a target_modules regex), matched
without catastrophic backtracking.

PEFT's rule: the first key with `re.match(rf"(.*\\.)?({key})$", module)` wins. Keys come from users and
`re` backtracks, so keys are bounded in count and length, plain keys are matched without `re`, and
any other key must be a "flat" regex (no nested repeats or alternation in a repeat, no backreference,
at most MAX_REPEATS repeats), compiled once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Optional

try:  # the regex parser of the standard library (3.11+: re._parser; 3.10: sre_parse)
    from re import _parser as _sre  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

from appliance.lora.adapter_files import AdapterError

MAX_KEYS = 1024  # one key per module of a 146-layer model: more than any real adapter carries
MAX_KEY_CHARS = 256
MAX_REPEATS = 2
_PLAIN = re.compile(r"[\w.\-]+", re.ASCII)
_REPEAT_OPS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}
_REFUSED_OPS = {"GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE", "GROUPREF_LOC_IGNORE", "GROUPREF_UNI_IGNORE"}


class Patterns:
    """A rank_pattern / alpha_pattern dict, checked and compiled once; `value(module)` is PEFT's lookup."""

    def __init__(self, patterns: Any, what: str, where: Path) -> None:
        if patterns is None:
            patterns = {}
        if not isinstance(patterns, dict):
            raise AdapterError(f"{where}: {what} must be an object of module pattern -> value, got "
                               f"{type(patterns).__name__}")
        if len(patterns) > MAX_KEYS:
            raise AdapterError(f"{where}: {what} has {len(patterns)} keys, more than the {MAX_KEYS} allowed")
        self._keys: list[tuple[Any, Optional[re.Pattern[str]], str]] = []
        for key, value in patterns.items():
            check_regex(key, f"{what} key", where)
            rx = None if _PLAIN.fullmatch(key) else _compile(rf"(?:.*\.)?(?:{key})$", f"{what} key", where)
            self._keys.append((value, rx, key))

    def value(self, module: str, default: Any) -> Any:
        for value, rx, key in self._keys:
            if (_plain_match(key, module) if rx is None else rx.match(module) is not None):
                return value
        return default


def check_regex(key: Any, what: str, where: Path) -> None:
    """Refuse a pattern that is not a string, too long, invalid, or not flat (module docstring)."""
    if not isinstance(key, str) or not key:
        raise AdapterError(f"{where}: {what} {key!r} must be a non-empty string")
    if len(key) > MAX_KEY_CHARS:
        raise AdapterError(f"{where}: {what} {key[:40]!r}... is {len(key)} characters, more than "
                           f"{MAX_KEY_CHARS}")
    if _PLAIN.fullmatch(key):
        return
    try:
        tree = _sre.parse(key)
    except re.error as e:
        raise AdapterError(f"{where}: {what} {key!r} is not a valid regex: {e}") from e
    except RecursionError as e:
        raise AdapterError(f"{where}: {what} {key[:40]!r} nests too deeply") from e
    repeats = _walk(tree, inside_repeat=False, key=key, what=what, where=where)
    if repeats > MAX_REPEATS:
        raise AdapterError(f"{where}: {what} {key!r} has {repeats} repeats (*, +, ?, {{m,n}}); at most "
                           f"{MAX_REPEATS} are allowed")


def fullmatches(pattern: str, names: Iterable[str], what: str, where: Path) -> set[str]:
    """The names a target_modules regex matches whole (PEFT's `re.fullmatch`), the regex checked first."""
    check_regex(pattern, what, where)
    if _PLAIN.fullmatch(pattern):
        return {n for n in names if len(n) == len(pattern) and all(k in (".", c) for k, c in zip(pattern, n))}
    rx = _compile(pattern, what, where)
    return {n for n in names if rx.fullmatch(n)}


def _compile(pattern: str, what: str, where: Path) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:  # e.g. inline flags not at the start, once wrapped
        raise AdapterError(f"{where}: {what} {pattern!r} is not a valid regex: {e}") from e


def _plain_match(key: str, name: str) -> bool:
    """`re.match(rf"(.*\\.)?({key})$", name)` for a key of [\\w.-] only: its dots match any character."""
    n = len(key)
    starts = [0] + [i + 1 for i, c in enumerate(name) if c == "."]
    for s in starts:
        part = name[s:]
        if len(part) == n and all(k == "." or k == c for k, c in zip(key, part)):
            return True
    return False


def _walk(items: Any, inside_repeat: bool, key: str, what: str, where: Path) -> int:
    """Repeats in a parsed pattern; AdapterError for a nested repeat, alternation in a repeat, a backref."""
    count = 0
    for op, av in items:
        name = str(op)
        if name in _REFUSED_OPS:
            raise AdapterError(f"{where}: {what} {key!r}: backreferences are not allowed")
        if name in _REPEAT_OPS:
            if inside_repeat:
                raise AdapterError(f"{where}: {what} {key!r}: a repeat inside a repeat (e.g. (a+)+) is not "
                                   "allowed: it can take exponential time to match")
            # an optional part (?, {0,1}) cannot repeat: what it holds is only not nested in it
            count += 1 + _walk(av[2], inside_repeat or av[1] != 1, key, what, where)
        elif name == "BRANCH":
            if inside_repeat:
                raise AdapterError(f"{where}: {what} {key!r}: an alternation inside a repeat (e.g. (a|ab)*) "
                                   "is not allowed: it can take exponential time to match")
            count += sum(_walk(b, inside_repeat, key, what, where) for b in av[1])
        elif name == "SUBPATTERN":
            count += _walk(av[3], inside_repeat, key, what, where)
        elif name in ("ASSERT", "ASSERT_NOT"):
            count += _walk(av[1], inside_repeat, key, what, where)
        elif name == "ATOMIC_GROUP":
            count += _walk(av, inside_repeat, key, what, where)
    return count
