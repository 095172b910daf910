"""Tool calls out of generated text, incrementally: Hermes `<tool_call>{"name": .., "arguments": {..}}</tool_call>`
blocks, a bare JSON call object (or an array of them), and the constrained output of `required` / named
`tool_choice` (a bare object or array, always valid).

One parser serves streams and whole answers: a whole answer is the text fed at once, so both carry the
same content and calls. Text outside the calls is content; markup never is. A call's header (id, name)
goes out once its `"name"` is read and its arguments object opens, then the arguments' raw text as it
arrives; a call whose keys come in another order (or `"parameters"` for `"arguments"`) goes out whole
when its object closes. A malformed block stays content. In `auto` mode an answer that opens with `{`
or `[` is held to the end, then is calls if it parses as calls, else content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The header of a call whose name comes first, up to the `{` that opens its arguments.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{$')


@dataclass
class CallDelta:
    """One piece of one call: the first carries id and name, later ones argument fragments."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class Delta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text


class _CallObject:
    """One `{"name": .., "arguments": {..}}` object, fed char by char until its closing brace."""

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.depth = 0
        self.in_str = self.escape = False
        self.name: Optional[str] = None  # read from a name-first header
        self.value_start: Optional[int] = None  # index of the arguments' `{` (name-first calls)
        self.value_end: Optional[int] = None
        self.call_index: Optional[int] = None  # its call, once the header went out
        self.sent = 0  # chars of its arguments already sent
        self.done = False

    def feed(self, text: str) -> int:
        """Consume text until the object closes; returns how many chars were taken."""
        for i, ch in enumerate(text):
            self.chars.append(ch)
            if self.in_str:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_str = False
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
                if self.depth == 2 and ch == "{" and self.name is None:
                    self._header()
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self.value_start is not None and self.value_end is None:
                    self.value_end = len(self.chars)
                if self.depth <= 0:
                    self.done = True
                    return i + 1
        return len(text)

    def _header(self) -> None:
        text = self.text()
        m = _HEADER.match(text)
        if m is None:
            return
        try:
            self.name = json.loads(m.group(1))
        except ValueError:
            return
        self.value_start = len(text) - 1

    def text(self) -> str:
        return "".join(self.chars)

    def arguments(self) -> str:
        """The arguments' raw text read so far (name-first calls)."""
        return "".join(self.chars[self.value_start:self.value_end])


def as_call(text: str) -> Optional[tuple[str, str]]:
    """(name, arguments JSON text) of a call object in any key order; None if `text` is no call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _call_of(obj)


def _call_of(obj: object) -> Optional[tuple[str, str]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, dict):
        return obj["name"], json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return obj["name"], args
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """`feed(text)` per generated delta, `finish()` at the end; both return the Delta to send.
    `forced`: the output is constrained to a call object or an array of them (required / named)."""

    def __init__(self, forced: bool = False) -> None:
        self.forced = forced
        self.content = ""  # every piece of content sent
        self.calls: list[Call] = []
        self._buf = ""  # text not consumed yet
        self._held_ws = ""  # trailing whitespace of the content, dropped if a call follows
        self._state = "start"  # start | text | tag | object | raw | after | lead | bare
        self._obj: Optional[_CallObject] = None
        self._out = Delta()

    def feed(self, text: str) -> Delta:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> Delta:
        self._run(final=True)
        if self._state == "start":
            self._held_ws += self._buf
        elif self._state == "bare":
            self._finish_bare()
        elif self._state in ("object", "raw"):
            self._finish_open_object()
        elif self._state == "tag":
            self._content(OPEN + self._buf)
        self._buf = ""
        if not self.calls and self._held_ws:  # a plain answer keeps its text exactly
            self._emit_content(self._held_ws)
        self._held_ws = ""
        return self._take()

    # ------------------------------------------------------------------------------ states
    def _run(self, final: bool) -> None:
        while self._buf:
            before = (self._state, len(self._buf))
            getattr(self, "_" + self._state)(final)
            if (self._state, len(self._buf)) == before:
                return  # waits for more text

    def _start(self, final: bool) -> None:
        stripped = self._buf.lstrip()
        if not stripped:
            return
        self._held_ws += self._buf[:len(self._buf) - len(stripped)]
        self._buf = stripped
        self._state = "bare" if self.forced or stripped[0] in "{[" else "text"

    def _text(self, final: bool) -> None:
        i = self._buf.find(OPEN)
        if i != -1:
            self._content(self._buf[:i])
            self._buf = self._buf[i + len(OPEN):]
            self._state = "tag"
            return
        keep = 0 if final else _partial_len(self._buf, OPEN)
        self._content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _tag(self, final: bool) -> None:
        stripped = self._buf.lstrip()
        if not stripped:
            return
        self._buf = stripped
        self._obj = _CallObject()
        self._state = "object" if stripped[0] == "{" else "raw"

    def _object(self, final: bool) -> None:
        obj = self._obj
        assert obj is not None
        self._buf = self._buf[obj.feed(self._buf):]
        self._send(obj)
        if obj.done:
            if self._close(obj):
                self._obj = None
                self._state = "after"
            else:
                self._state = "raw"  # no call: the block stays content, up to its end tag

    def _raw(self, final: bool) -> None:
        """A block that is no call: content, markup included, up to and with its end tag."""
        obj = self._obj
        assert obj is not None
        i = self._buf.find(CLOSE)
        if i == -1:
            keep = 0 if final else _partial_len(self._buf, CLOSE)
            obj.chars.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return
        self._content(OPEN + obj.text() + self._buf[:i + len(CLOSE)])
        self._buf = self._buf[i + len(CLOSE):]
        self._obj = None
        self._state = "text"

    def _after(self, final: bool) -> None:
        """After a call's object: its end tag (markup), or text again if the model left it out."""
        stripped = self._buf.lstrip()
        if not stripped:
            self._buf = ""
        elif stripped.startswith(CLOSE):
            self._buf = stripped[len(CLOSE):]
            self._state = "lead"
        elif not final and CLOSE.startswith(stripped):
            self._buf = stripped
        else:
            self._buf = stripped
            self._state = "text"

    def _lead(self, final: bool) -> None:
        """Whitespace between a call and what follows is markup."""
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "text"

    def _bare(self, final: bool) -> None:
        if not self.forced:
            return  # auto: held to the end (_finish_bare)
        while self._buf:
            if self._obj is None:
                self._buf = self._buf.lstrip(" \t\r\n[,]")
                if not self._buf:
                    return
                if self._buf[0] != "{":
                    self._buf = ""  # cannot happen under the grammar: nothing but calls goes out
                    return
                self._obj = _CallObject()
            obj = self._obj
            self._buf = self._buf[obj.feed(self._buf):]
            self._send(obj)
            if not obj.done:
                return
            self._close(obj)
            self._obj = None

    # ------------------------------------------------------------------------------ ends
    def _finish_bare(self) -> None:
        if self.forced:
            if self._obj is not None:
                self._finish_open_object()
            return
        try:
            obj = json.loads(self._buf)
        except ValueError:
            obj = None
        calls = [_call_of(x) for x in (obj if isinstance(obj, list) and obj else [obj])]
        if any(c is None for c in calls):
            self._content(self._buf)
            return
        for c in calls:
            assert c is not None
            self._new_call(*c)

    def _finish_open_object(self) -> None:
        """The output ended inside a call: a started one stands (cut short: finish_reason length); one
        not started is a call if its text parses, else content."""
        obj = self._obj
        assert obj is not None
        self._obj = None
        if obj.call_index is not None:
            return
        whole = as_call(obj.text()) if self._state != "raw" else None
        if whole is not None:
            self._new_call(*whole)
        elif not self.forced:
            self._content(OPEN + obj.text() + self._buf)

    def _close(self, obj: _CallObject) -> bool:
        """A call object just closed: True if it was a call (sent by now), False if it is none."""
        if obj.call_index is not None:
            return True
        whole = as_call(obj.text())
        if whole is None:
            return False
        self._new_call(*whole)
        return True

    # ------------------------------------------------------------------------------ output
    def _send(self, obj: _CallObject) -> None:
        """The header of a name-first call once its arguments open, then their new text."""
        if obj.name is None or obj.value_start is None:
            return
        if obj.call_index is None:
            self._new_call(obj.name, "")
            obj.call_index = len(self.calls) - 1
        new = obj.arguments()[obj.sent:]
        if new:
            obj.sent += len(new)
            self.calls[obj.call_index].arguments += new
            self._add(CallDelta(obj.call_index, arguments=new))

    def _new_call(self, name: str, arguments: str) -> None:
        self._held_ws = ""
        call = Call(new_call_id(), name, arguments)
        self.calls.append(call)
        self._add(CallDelta(len(self.calls) - 1, id=call.id, name=name, arguments=arguments))

    def _add(self, d: CallDelta) -> None:
        calls = self._out.calls
        if calls and calls[-1].index == d.index:
            calls[-1].arguments += d.arguments
        else:
            calls.append(d)

    def _content(self, text: str) -> None:
        """Content, with trailing whitespace held back (dropped if a call comes next)."""
        body = text.rstrip()
        if body:
            self._emit_content(self._held_ws + body)
            self._held_ws = text[len(body):]
        else:
            self._held_ws += text

    def _emit_content(self, text: str) -> None:
        self.content += text
        self._out.content += text

    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out


def _partial_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse(text: str, forced: bool = False) -> tuple[Optional[str], list[Call]]:
    """A whole answer: its content (None when empty) and its calls."""
    p = ToolCallParser(forced)
    p.feed(text)
    p.finish()
    return (p.content or None), p.calls
