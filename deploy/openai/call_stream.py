"""Tool calls' JSON read as it arrives, for the ``"auto"`` parsers (``tool_parsers``,
``trailing_call_parsers``), so a call streams argument by argument and what is sent is
always a prefix of what the whole answer gives.

- ``ObjectScan``: one JSON object's text, character by character: each top-level key
  and its value once the value is complete (checked by ``json.loads``), and whether the
  object closed or went wrong.
- ``StreamedCall``: a call as it can be sent: its name, and its arguments as the final
  JSON text (``json.dumps`` of the object, ``ensure_ascii=False``) grows by whole
  top-level pairs: ``{"city": "Paris"``, then ``, "days": 3``, then ``}``. What was sent
  never changes: a key's first value stands (a repeated key is ignored), and a call
  closes with the pairs it has when its text ends or goes wrong.
- ``JsonCall``: a call object (``{"name": ..., "arguments": {...}}``) or, its name
  known, an arguments object alone; ``JsonCalls``: call objects one after another (a
  JSON array, one object, or Llama 3's ``;``-separated ones).

A call is *ready* (sent) once its name is known and its first pair is complete (or its
arguments closed): before that, text that goes wrong means it was no call (its text is
content); after, it stays a call and the rest of its text is dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_WS = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\]*')


class ObjectScan:
    """A JSON object's text as it arrives, from the ``{`` (whitespace before it is
    skipped): ``pairs`` (key, value) as each value completes, ``starts`` where each
    key's first value began, ``end`` the offset just past the closing ``}``, ``failed``
    once the text is no JSON object. Nothing after the object is read."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # how far the text was read
        self.pairs: list[tuple[str, Any]] = []
        self.starts: dict[str, int] = {}
        self.end: int | None = None
        self.failed = False
        self._state = "open"
        self._key = ""
        self._mark = 0  # where the key or value being read began
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def done(self) -> bool:
        return self.failed or self.end is not None

    def _decoded(self, end: int) -> Any:
        try:
            return json.loads(self.text[self._mark:end])
        except (ValueError, RecursionError):
            self.failed = True
            return None

    def _value_done(self, end: int) -> None:
        value = self._decoded(end)
        if not self.failed:
            self.pairs.append((self._key, value))
            self._state = "after"

    def feed(self, more: str) -> None:
        self.text += more
        text, i = self.text, self.pos
        while i < len(text) and not self.done:
            ch, state = text[i], self._state
            if state in ("key", "string") or self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch != '"':
                    i = _STRING_RUN.match(text, i).end()
                    continue
                elif state == "key":
                    self._key, self._state = self._decoded(i + 1), "colon"
                elif state == "string":
                    self._value_done(i + 1)
                else:
                    self._in_string = False
            elif state == "nested":
                if ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._depth += 1
                elif ch in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        self._value_done(i + 1)
            elif state == "scalar":
                if ch in _WS or ch in ',:}]{["':
                    self._value_done(i)
                    continue  # the character is read again after the value
            elif ch in _WS:
                pass
            elif state == "open":
                self._state = "first" if ch == "{" else "?"
            elif state in ("first", "next") and ch == '"':
                self._state, self._mark = "key", i
            elif state == "first" and ch == "}" or state == "after" and ch == "}":
                self.end = i + 1
            elif state == "colon" and ch == ":":
                self._state = "value"
            elif state == "after" and ch == ",":
                self._state = "next"
            elif state == "value" and ch not in ",:}]":
                self.starts.setdefault(self._key, i)
                self._mark = i
                self._state = "string" if ch == '"' else "nested" if ch in "{[" else "scalar"
                self._depth = 1
            else:
                self._state = "?"
            self.failed = self.failed or self._state == "?"
            i += 1
        self.pos = i


@dataclass
class StreamedCall:
    """One call as it can be sent: ``name``, and ``arguments``, the final arguments JSON
    as far as it is known (whole top-level pairs; ``}`` once ``closed``). ``index`` and
    ``sent`` are the parser's: the call's index once announced, how much was sent."""

    name: str | None = None
    arguments: str = ""
    closed: bool = False
    #: announced on its name alone (the XML format, whose calls cannot go wrong)
    early: bool = False
    index: int | None = None
    sent: int = 0
    keys: set[str] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return self.name is not None and (self.early or bool(self.arguments) or self.closed)

    def add(self, key: str, value: Any) -> bool:
        """Adds a pair (a repeated key is ignored); False when it is no JSON."""
        if self.closed or key in self.keys:
            return True
        try:
            pair = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        except (ValueError, TypeError, RecursionError):
            return False
        self.keys.add(key)
        self.arguments += (", " if self.arguments else "{") + pair
        return True

    def close(self) -> None:
        if not self.closed:
            self.arguments += "}" if self.arguments else "{}"
            self.closed = True


class JsonCall:
    """One call's JSON as it arrives: a call object (a non-empty string ``name``; the
    arguments object under the first of ``argument_keys`` to appear, or a JSON string
    holding one, or none: ``{}``; other keys are ignored), or with ``name`` given the
    arguments object alone. ``call`` grows as pairs complete. ``failed``: it went wrong
    before it was ready, so it is no call; ``wrong``: it went wrong (or its text ended)
    after, so it closed with what it had; ``scan.end``: the object closed."""

    def __init__(self, argument_keys: tuple[str, ...] = (), name: str | None = None) -> None:
        self.argument_keys = argument_keys
        self.call = StreamedCall(name)
        self.scan = ObjectScan()
        self.args: ObjectScan | None = self.scan if name is not None else None
        self.failed = self.wrong = False
        self._named = name is not None
        self._args_key: str | None = "" if name is not None else None
        self._seen = self._added = 0  # the call object's and the arguments' pairs looked at

    def _stop(self) -> None:
        if self.call.ready:
            self.call.close()
            self.wrong = True
        else:
            self.failed = True

    def feed(self, more: str) -> None:
        if self.failed or self.wrong:
            return
        scan = self.scan
        scan.feed(more)
        if self._args_key is None:
            key = next((k for k in scan.starts if k in self.argument_keys), None)
            if key is not None:
                self._args_key, start = key, scan.starts[key]
                if scan.text[start] == "{":
                    self.args = ObjectScan()
                    self.args.feed(scan.text[start:])
                elif scan.text[start] != '"':
                    return self._stop()
        elif self.args is not None and self.args is not scan:
            self.args.feed(more)
        if self.args is not scan:
            for key, value in scan.pairs[self._seen:]:
                if key == "name" and not self._named:
                    self._named = True
                    if not isinstance(value, str) or not value:
                        return self._stop()
                    self.call.name = value
                elif key == self._args_key and self.args is None:  # a JSON string holding the object
                    self.args = ObjectScan()
                    self.args.feed(value)
                    if self.args.end is None or self.args.text[self.args.end:].strip(_WS):
                        return self._stop()
            self._seen = len(scan.pairs)
        self._take_arguments()
        if self.failed or self.wrong:
            return
        if scan.failed:
            return self._stop()
        if scan.end is not None:
            if self.call.name is None:
                return self._stop()
            self.call.close()  # no arguments: {}

    def _take_arguments(self) -> None:
        args = self.args
        if args is None:
            return
        for key, value in args.pairs[self._added:]:
            if not self.call.add(key, value):
                return self._stop()
        self._added = len(args.pairs)
        if args.end is not None:
            self.call.close()
        elif args.failed:
            self._stop()

    def close(self) -> None:
        """The call's text ended (its end tag, or the output's end)."""
        if not (self.failed or self.wrong or self.scan.end is not None):
            self._stop()


class JsonCalls:
    """Call objects one after another as they arrive: a JSON array of them (``mode``
    ``"array"``), one object (``"one"``), either as the text begins (``"any"``), or
    any number separated by whitespace and ``;`` (``"sequence"``, Llama 3). ``calls``:
    those ready so far; ``failed``: the first is no call (the text is content);
    ``rest``: the text after the calls (Llama 3: from the first object that is no
    call), None until it begins, and always None once a ready call went wrong (the
    rest of the text is dropped)."""

    def __init__(self, mode: str, argument_keys: tuple[str, ...]) -> None:
        self.mode, self.argument_keys = mode, argument_keys
        self.calls: list[StreamedCall] = []
        self.failed = False
        self.rest: str | None = None
        self._dropped = False
        self._current: JsonCall | None = None
        self._state = "start" if mode in ("array", "any") else "item"

    def _ready(self, current: JsonCall) -> None:
        if current.call.ready and (not self.calls or self.calls[-1] is not current.call):
            self.calls.append(current.call)

    def _no_call(self, text: str) -> None:
        """The text from here is no call."""
        if not self.calls:
            self.failed = True
        elif self.mode == "sequence":
            self.rest = text
        else:
            self._dropped = True

    def feed(self, text: str) -> None:
        if self.rest is not None:
            self.rest += text
            return
        while text and not (self.failed or self._dropped or self.rest is not None):
            current = self._current
            if current is None:
                text = self._between(text)
                continue
            current.feed(text)
            self._ready(current)
            if current.failed:
                return self._no_call(current.scan.text)
            self._dropped = current.wrong
            if current.scan.end is None:
                return
            text, self._current = current.scan.text[current.scan.end:], None
            self._state = "done" if self.mode == "one" else "between"

    def _between(self, text: str) -> str:
        """Reads the text between objects; what is left from a new object's ``{``."""
        for i, ch in enumerate(text):
            state = self._state
            if state == "done":
                self.rest = text[i:]
            elif ch in _WS or ch == ";" and self.mode == "sequence":
                continue
            elif state == "start" and ch == "[":
                self.mode, self._state = "array", "item"
                continue
            elif ch == "{" and (state in ("item", "start") or self.mode == "sequence"):
                self.mode = "one" if self.mode == "any" else self.mode
                self._current = JsonCall(self.argument_keys)
                return text[i:]
            elif state == "between" and self.mode == "array" and ch in ",]":
                self._state = "item" if ch == "," else "done"
                continue
            else:
                self._no_call(text[i:])
            return ""
        return ""

    def close(self) -> None:
        """The text ended."""
        current = self._current
        if current is not None and not (self.failed or self._dropped or self.rest is not None):
            current.close()
            self._ready(current)
            if current.failed:
                self._no_call(current.scan.text)
        if not self.calls:
            self.failed = True


@dataclass
class Stripped:
    """A growing text sent without its whitespace at either end (held back at the end
    until more text follows it)."""

    sent: int = 0

    def take(self, text: str) -> str:
        body = text.strip()
        piece, self.sent = body[self.sent:], len(body)
        return piece
