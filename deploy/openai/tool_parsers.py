"""Tool calls out of generated text, whole or streamed: one parser object per choice,
fed the text as it comes (``feed``) and told when it ends (``finish``). Both return
``(content, tool call deltas)``; a non-streamed answer is ``feed(text)`` then
``finish()``, so a stream and a whole answer give the same calls by construction,
wherever the text was split.

- ``PlainParser``: no tool calls (no tools, or ``tool_choice: "none"``).
- ``NamedFunctionParser``: ``tool_choice`` names a function; the grammar made the whole
  output that function's arguments object.
- ``RequiredCallsParser``: ``tool_choice: "required"``; the grammar made the output a
  JSON array of ``{"name", "parameters"}`` objects (vLLM's format).
- ``HermesToolParser`` (``--tool-call-parser hermes``) and ``Llama3JsonToolParser``
  (``llama3_json``): ``tool_choice: "auto"``, the model's own format, which nothing
  constrained, so anything malformed stays content. The formats whose calls run to the
  end of the output are in ``trailing_call_parsers``; every name in
  ``tool_parser_names``.

Every call streams as vLLM streams it: the first delta of a call carries its id, type
and name, later ones pieces of its arguments' text. Named and required calls send the
arguments as generated (the grammar guarantees them). A parsed ("auto") call is sent
once it is ready (``call_stream``: its name known and its first argument complete),
then its arguments by whole top-level pairs of the final, normalised arguments JSON,
so what was sent never changes: before it is ready, text that goes wrong leaves the
call's text content; after, the call closes with the arguments it had and the rest of
its text is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from deploy.openai.call_stream import JsonCall, JsonCalls, StreamedCall, Stripped


def new_tool_call_id() -> str:
    """vLLM's tool call ids."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """A piece of one tool call: the first piece of a call has ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


Emitted = tuple[str, list[ToolCallDelta]]


def marker_overlap(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``
    (text that may yet become the marker, held back while streaming)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class ToolCallParser:
    """The accumulated result (``content``, ``calls``) of what was emitted so far; the
    subclasses decide what to emit."""

    #: whether calls after the first are dropped (``parallel_tool_calls: false``)
    single_call: bool = False
    #: each tool's parameters schema, by function name (formats whose arguments are
    #: text take their types from it)
    schemas: dict[str, Any] = field(default_factory=dict)
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finished: bool = False
    _announced: int = 0  # calls announced (the next call's index)

    name: ClassVar[str] = "plain"
    #: its markers may be special tokens, which the text shows only with
    #: ``skip_special_tokens`` off (vLLM turns it off for these parsers too)
    KEEPS_SPECIAL_TOKENS: ClassVar[bool] = False

    def feed(self, text: str) -> Emitted:
        raise NotImplementedError

    def finish(self) -> Emitted:
        raise NotImplementedError

    @staticmethod
    def _call_id() -> str:
        return new_tool_call_id()

    def _pieces(self, call: StreamedCall) -> list[ToolCallDelta]:
        """What of ``call`` can be sent now: once it is ready its id, type and name,
        then its arguments text as it grows."""
        if not call.ready:
            return []
        out = []
        if call.index is None:
            call.index, self._announced = self._announced, self._announced + 1
            out.append(ToolCallDelta(call.index, "", self._call_id(), call.name))
        if len(call.arguments) > call.sent:
            out.append(ToolCallDelta(call.index, call.arguments[call.sent:]))
            call.sent = len(call.arguments)
        return out

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output: its content and its calls."""
        self.feed(text)
        self.finish()
        return self.content, self.calls

    def _emit(self, content: str, deltas: list[ToolCallDelta]) -> Emitted:
        if self.single_call:
            deltas = [d for d in deltas if d.index == 0]
        self.content += content
        for d in deltas:
            if d.index == len(self.calls):
                self.calls.append(ToolCall(d.id or new_tool_call_id(), d.name or "", d.arguments))
            else:
                self.calls[d.index].arguments += d.arguments
        return content, deltas


class PlainParser(ToolCallParser):
    def feed(self, text: str) -> Emitted:
        return self._emit(text, [])

    def finish(self) -> Emitted:
        self.finished = True
        return "", []


@dataclass
class NamedFunctionParser(ToolCallParser):
    """The whole output is the named function's arguments (whitespace around the
    object dropped)."""

    function: str = ""
    _pending: str = ""
    _started: bool = False

    def feed(self, text: str) -> Emitted:
        text = self._pending + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._pending = text[len(body):]
        if not body:
            return self._emit("", [])
        if self._started:
            return self._emit("", [ToolCallDelta(0, body)])
        self._started = True
        return self._emit("", [ToolCallDelta(0, body, new_tool_call_id(), self.function)])

    def finish(self) -> Emitted:
        self.finished = True
        return self._emit("", [])


@dataclass
class _Element:
    """One ``{"name": ..., "parameters": ...}`` object of the required-calls array:
    offsets into the text, known as soon as the scan reaches them."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    sent: int | None = None  # offset up to which its arguments were emitted
    index: int | None = None  # its call index once announced


# Scan states for the values of an element object.
_KEY, _COLON, _VALUE, _STRING, _CONTAINER, _SCALAR, _AFTER = range(7)


@dataclass
class RequiredCallsParser(ToolCallParser):
    """``[{"name": "f", "parameters": {...}}, ...]``, scanned once, character by
    character, as it arrives: a call is announced when its name is complete and its
    parameters have started, then its parameters' text streams as generated. Only the
    element level is interpreted; strings and nesting inside values are skipped."""

    _text: str = ""
    _pos: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0
    _elements: list[_Element] = field(default_factory=list)
    _cur: _Element | None = None
    _state: int = _KEY
    _key: str | None = None
    _value_start: int = 0
    _done: bool = False  # the array closed (or the text is not an array): the rest is ignored

    def _end_value(self, end: int) -> None:
        cur = self._cur
        if self._key == "parameters":
            cur.args_end = end
        elif self._key == "name" and self._state == _STRING:
            try:
                name = json.loads(self._text[self._value_start:end])
                cur.name = name if isinstance(name, str) else None
            except ValueError:
                cur.name = None
        self._state = _AFTER

    def _start_value(self, pos: int, state: int) -> None:
        self._value_start = pos
        if self._key == "parameters":
            self._cur.args_start = pos
        self._state = state

    def _scan(self) -> None:
        text = self._text
        for i in range(self._pos, len(text)):
            if self._done:
                break
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 2 and self._cur is not None:
                        if self._state == _KEY:
                            self._key = text[self._string_start + 1:i]
                            self._state = _COLON
                        elif self._state == _STRING:
                            self._end_value(i + 1)
                continue
            if ch == '"':
                self._in_string, self._string_start = True, i
                if self._depth == 2 and self._cur is not None and self._state == _VALUE:
                    self._start_value(i, _STRING)
            elif ch in "{[":
                if self._depth == 0 and ch != "[" or self._depth == 1 and ch != "{":
                    self._done = True
                    break
                if self._depth == 1:
                    self._cur = _Element()
                    self._elements.append(self._cur)
                    self._state, self._key = _KEY, None
                elif self._depth == 2 and self._cur is not None and self._state == _VALUE:
                    self._start_value(i, _CONTAINER)
                self._depth += 1
            elif ch in "}]":
                if self._depth == 2 and self._cur is not None and self._state == _SCALAR:
                    self._end_value(i)
                self._depth -= 1
                if self._depth == 2 and self._cur is not None and self._state == _CONTAINER:
                    self._end_value(i + 1)
                elif self._depth == 1:
                    self._cur = None
                elif self._depth <= 0:
                    self._done = True
            elif self._depth == 2 and self._cur is not None:
                if ch == ":":
                    if self._state == _COLON:
                        self._state = _VALUE
                elif ch == ",":
                    if self._state == _SCALAR:
                        self._end_value(i)
                    self._state, self._key = _KEY, None
                elif ch.isspace():
                    if self._state == _SCALAR:
                        self._end_value(i)
                elif self._state == _VALUE:
                    self._start_value(i, _SCALAR)
        self._pos = len(text)

    def _deltas(self) -> list[ToolCallDelta]:
        deltas = []
        for element in self._elements:
            if element.name is None or element.args_start is None:
                break  # elements come in order: nothing later is ready either
            end = element.args_end if element.args_end is not None else len(self._text)
            if element.index is None:
                element.index = len(self.calls) + sum(1 for d in deltas if d.id is not None)
                deltas.append(ToolCallDelta(element.index, self._text[element.args_start:end], new_tool_call_id(),
                                            element.name))
            elif end > element.sent:
                deltas.append(ToolCallDelta(element.index, self._text[element.sent:end]))
            element.sent = end
        return deltas

    def feed(self, text: str) -> Emitted:
        self._text += text
        self._scan()
        return self._emit("", self._deltas())

    def finish(self) -> Emitted:
        self.finished = True
        return self._emit("", [])


@dataclass
class HermesToolParser(ToolCallParser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    any number of them, with text around. Text streams as content until a start tag
    could begin (a partial ``<tool_call`` is held back); the text between the tags is
    read as it comes (``_new_body``: a ``JsonCall``, a string ``name`` and an object
    ``arguments``, or ``parameters``, or a JSON string holding one), and the call
    streams once it is ready. One that is not ready by its end tag (or the output's
    end) stays content, tags included. The whitespace around calls is dropped, except
    that content resuming after calls is separated from the content before them by
    the whitespace that preceded the first of those calls; an output without calls
    keeps its text exactly."""

    name: ClassVar[str] = "hermes"
    KEEPS_SPECIAL_TOKENS: ClassVar[bool] = True  # some models' <tool_call> is one
    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"

    _buf: str = ""
    _in_call: bool = False
    _searched: int = 0  # in a call: how much of the buffer is known to hold no end tag
    _body: Any = None  # the call being read
    _fed: int = 0  # how much of the buffer (the call's text) its body was fed
    _pending_ws: str = ""  # trailing whitespace of the content, held back
    _after_call: bool = False  # content right after a call drops its leading whitespace
    _ws_before_call: str = ""
    _separator: str = ""  # what goes between the content before calls and the content after
    _had_content: bool = False

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
            text, self._separator = self._separator + text, ""
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        self._had_content = self._had_content or bool(body)
        return body

    def _new_body(self) -> Any:
        """What reads a call's text: ``feed``, ``close``, and its ``call``."""
        return JsonCall(("arguments", "parameters"))

    def _body_pieces(self, limit: int) -> list[ToolCallDelta]:
        """Feeds the call's text up to ``limit`` to its body; what of it can be sent."""
        if limit > self._fed:
            self._body.feed(self._buf[self._fed:limit])
            self._fed = limit
        call = self._body.call
        if call.ready and call.index is None:
            if not self._after_call:
                self._separator = self._ws_before_call if self._had_content else ""
            self._after_call = True
        return self._pieces(call)

    def _end_call(self, end: int, closed: bool) -> Emitted:
        """The call's text ended at ``end``: its last pieces, or its text as content."""
        pieces = self._body_pieces(end)
        self._body.close()
        pieces += self._body_pieces(end)
        self._in_call = False
        if self._body.call.ready:
            return "", pieces
        self._pending_ws = self._ws_before_call
        return self._content(self.START + self._buf[:end] + (self.END if closed else "")), []

    def feed(self, text: str) -> Emitted:
        self._buf += text
        content, deltas = "", []
        while True:
            if not self._in_call:
                start = self._buf.find(self.START)
                if start < 0:
                    keep = marker_overlap(self._buf, self.START)
                    content += self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content += self._content(self._buf[:start])
                self._ws_before_call, self._pending_ws = self._pending_ws, ""
                self._buf = self._buf[start + len(self.START):]
                self._in_call, self._searched, self._body, self._fed = True, 0, self._new_body(), 0
            else:
                end = self._buf.find(self.END, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._buf) - len(self.END) + 1)
                    deltas += self._body_pieces(len(self._buf) - marker_overlap(self._buf, self.END))
                    break
                more, new = self._end_call(end, closed=True)
                self._buf = self._buf[end + len(self.END):]
                content, deltas = content + more, deltas + new
        return self._emit(content, deltas)

    def finish(self) -> Emitted:
        self.finished = True
        if self._in_call:
            content, deltas = self._end_call(len(self._buf), closed=False)
        else:
            content, deltas = self._content(self._buf), []
        self._buf = ""
        if not self.calls and not deltas:
            content += self._pending_ws  # no calls: the text exactly as generated
        self._pending_ws = ""
        return self._emit(content, deltas)


@dataclass
class RegionParser(ToolCallParser):
    """A format whose calls take the rest of the output from where they begin: text
    streams as content until ``_region_at`` finds the calls' region; its text then goes
    to a scanner (``_new_region``: ``feed``, ``close``, the ``calls`` ready so far,
    ``failed``, ``rest``) whose calls stream as they become ready, and the text after
    them (``rest``) as content, without the whitespace around it. A region whose first
    call is no call is content, all of it (held until then)."""

    _buf: str = ""
    _mode: str = "content"  # then "region"; "content only" once the output holds no calls
    _region: Any = None
    _held: str | None = None  # the region's text while it may yet be content
    _rest: Stripped = field(default_factory=Stripped)

    def _region_at(self, text: str) -> tuple[int, int | None]:
        """(how much of the text held so far is content for sure, where the calls'
        region begins past its marker, or None while it has not)."""
        raise NotImplementedError

    def _new_region(self) -> Any:
        raise NotImplementedError

    def _step(self, text: str, final: bool = False) -> Emitted:
        region = self._region
        region.feed(text)
        if final:
            region.close()
        if self._held is not None:
            self._held += text
        if region.failed:
            self._mode, held, self._held = "content only", self._held or "", None
            return held, []
        if region.calls:
            self._held = None
        deltas = [d for call in region.calls for d in self._pieces(call)]
        return ("" if region.rest is None else self._rest.take(region.rest)), deltas

    def feed(self, text: str) -> Emitted:
        if self._mode == "region":
            return self._emit(*self._step(text))
        if self._mode == "content only":
            return self._emit(text, [])
        self._buf += text
        at, body = self._region_at(self._buf)
        content = self._buf[:at]
        if body is None:
            self._buf = self._buf[at:]
            return self._emit(content, [])
        self._mode, self._region = "region", self._new_region()
        self._held, rest, self._buf = self._buf[at:body], self._buf[body:], ""
        more, deltas = self._step(rest)
        return self._emit(content + more, deltas)

    def finish(self) -> Emitted:
        self.finished = True
        if self._mode == "region":
            return self._emit(*self._step("", final=True))
        text, self._buf = self._buf, ""
        return self._emit(text, [])


@dataclass
class DecidedByStart(RegionParser):
    """A format whose output is calls or not by how it starts (``_opens``): held while
    the start cannot tell, then content, or all of it the calls' region (from
    ``_body_start``, past any tag)."""

    def _opens(self, start: str) -> bool | None:
        """Whether an output beginning ``start`` holds calls (None: too short to tell)."""
        raise NotImplementedError

    def _body_start(self, text: str) -> int:
        return 0

    def _region_at(self, text: str) -> tuple[int, int | None]:
        opens = self._opens(text)
        if opens is None:
            return 0, None
        if not opens:
            self._mode = "content only"
            return len(text), None
        return 0, self._body_start(text)


@dataclass
class Llama3JsonToolParser(DecidedByStart):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls: the output is
    ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
    ``<|python_tag|>``, several separated by ``;``. An output that starts otherwise is
    content and streams as such; one that starts like a call streams its calls
    (``JsonCalls``), and the text after them is content; if the first is no call, all
    of it is content."""

    name: ClassVar[str] = "llama3_json"
    TAG: ClassVar[str] = "<|python_tag|>"

    def _opens(self, start: str) -> bool | None:
        head = start.lstrip()
        if not head or (self.TAG.startswith(head) and len(head) < len(self.TAG)):
            return None
        return head.startswith(self.TAG) or head.startswith("{")

    def _body_start(self, text: str) -> int:
        head = len(text) - len(text.lstrip())
        return head + len(self.TAG) if text.startswith(self.TAG, head) else head

    def _new_region(self) -> JsonCalls:
        return JsonCalls("sequence", ("parameters", "arguments"))
