"""Tool call formats whose calls run to the end of the output: ``PythonicToolParser``
(``pythonic``: Llama 3.2 / ToolACE's Python list of calls; ``llama4_pythonic``: the same
between Llama 4's python tags), ``MistralToolParser`` (``mistral``: ``[TOOL_CALLS]`` and
a JSON array, or ``name[ARGS]{...}`` per call from tokenizer v11),
``DeepSeekV3ToolParser`` (``deepseek_v3``), ``GraniteToolParser`` (``granite``),
``InternLMToolParser`` (``internlm``) and ``HarmonyToolParser`` (``openai``: gpt-oss).
Text before the calls streams as content; each call streams once it is ready, by whole
arguments (``call_stream``); calls that turn out to be none leave their text content.
"""

from __future__ import annotations

import ast
import keyword
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cluster.reasoning_parsers import HarmonySplit
from deploy.openai.call_stream import JsonCall, JsonCalls, StreamedCall
from deploy.openai.tool_parsers import (
    DecidedByStart,
    Emitted,
    RegionParser,
    ToolCallParser,
    marker_overlap,
)


class _NotLiteral(ValueError):
    """A pythonic call argument that is not a JSON value."""


def _literal(node: ast.expr) -> Any:
    """A pythonic call argument as its JSON value: constants, lists, dicts with
    constant keys, and the JSON names some models write (``null``, ``true``, ``false``)."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
        raise _NotLiteral(type(node.value).__name__)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
        return -node.operand.value
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in node.keys):
            raise _NotLiteral("dict keys")
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[union-attr]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Name) and node.id in ("null", "true", "false"):
        return {"null": None, "true": True, "false": False}[node.id]
    raise _NotLiteral(type(node).__name__)


def _is_name(text: str) -> bool:
    return all(part.isidentifier() and not keyword.iskeyword(part) for part in text.split("."))


class PythonicCalls:
    """A Python list of keyword-argument calls as it arrives,
    ``[get_weather(city="Paris"), f(x=1)]`` (dotted names; values JSON literals, as
    ``_literal`` reads them), each call ready once its first argument is complete (or it
    closed); ``rest``: the text after the list. ``drop``: a marker removed wherever it is
    (Llama 4's end tag)."""

    def __init__(self, drop: str = "") -> None:
        self.calls: list[StreamedCall] = []
        self.failed = False
        self.rest: str | None = None
        self._drop, self._raw = drop, ""
        self._text, self._pos, self._state, self._mark, self._key = "", 0, "list", 0, ""
        self._call: StreamedCall | None = None
        self._depth, self._quote, self._escaped, self._dropped = 0, "", False, False

    def _take(self) -> None:
        if self._call is not None and self._call.ready and (not self.calls or self.calls[-1] is not self._call):
            self.calls.append(self._call)

    def _fail(self) -> None:
        """The text went wrong (or ended): a ready call closes, and what follows is
        dropped; with none ready, the text is no calls."""
        if self._call is not None and self._call.ready:
            self._call.close()
            self._take()
        self.failed, self._dropped = not self.calls, True

    def _value_done(self, end: int) -> None:
        try:
            value = _literal(ast.parse(self._text[self._mark:end].strip(), mode="eval").body)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return self._fail()
        if not self._call.add(self._key, value):
            return self._fail()
        self._state = "after value"

    def _scan(self, final: bool = False) -> None:
        text, i = self._text, self._pos
        while i < len(text) and not (self._dropped or self.rest is not None):
            ch, state = text[i], self._state
            if state == "value":
                if self._quote:
                    if self._escaped:
                        self._escaped = False
                    elif ch == "\\":
                        self._escaped = True
                    elif text.startswith(self._quote, i):
                        i, self._quote = i + len(self._quote), ""
                        continue
                    elif len(self._quote) == 3 and self._quote.startswith(text[i:]) and not final:
                        break  # the end of a triple quote, perhaps
                elif ch in "'\"":
                    if not final and len(text) - i < 3 and text[i:] == ch * (len(text) - i):
                        break  # a triple quote, perhaps
                    self._quote = ch * 3 if text.startswith(ch * 3, i) else ch
                    i += len(self._quote)
                    continue
                elif ch in "([{":
                    self._depth += 1
                elif ch in ")]}" and self._depth:
                    self._depth -= 1
                elif ch in ",)" and not self._depth:
                    self._value_done(i)
                    continue  # the delimiter is read again after the value
                elif ch in "]}" and not self._depth:
                    self._fail()
                i += 1
                continue
            if state in ("name", "keyword") and (ch == "_" or ch == "." and state == "name" or ch.isalnum()):
                i += 1
                continue
            if state in ("name", "keyword"):
                word = text[self._mark:i]
                if not _is_name(word):
                    self._fail()
                elif state == "name":
                    self._call, self._state = StreamedCall(word), "paren"
                else:
                    self._key, self._state = word, "equals"
                continue
            if ch.isspace():
                pass
            elif state == "list" and ch == "[" or state == "after call" and ch == ",":
                self._state = "item"
            elif state in ("item", "after call") and ch == "]" and (self.calls or state == "after call"):
                self.rest = text[i + 1:]
            elif state in ("item", "keywords") and (ch == "_" or ch.isalpha()):
                self._mark, self._state = i, "name" if state == "item" else "keyword"
            elif state == "paren" and ch == "(":
                self._state = "keywords"
            elif state == "equals" and ch == "=":
                self._mark, self._depth, self._state = i + 1, 0, "value"
            elif state == "after value" and ch == ",":
                self._state = "keywords"
            elif state in ("keywords", "after value") and ch == ")":
                self._call.close()
                self._state = "after call"
            else:
                self._fail()
            self._take()
            i += 1
        self._pos = i

    def feed(self, more: str) -> None:
        if self._drop:
            raw = (self._raw + more).replace(self._drop, "")
            keep = marker_overlap(raw, self._drop)
            more, self._raw = raw[:len(raw) - keep], raw[len(raw) - keep:]
        if self.rest is not None:
            self.rest += more
            return
        self._text += more
        self._scan()

    def close(self) -> None:
        more, self._raw = self._raw, ""
        self.feed(more)
        self._scan(final=True)
        if self.rest is None and not self._dropped:
            self._fail()  # the list was cut: the calls so far stand


@dataclass
class PythonicToolParser(DecidedByStart):
    """Llama 3.2 / Llama 4 / ToolACE pythonic calls: the output is a Python list of
    keyword-argument calls, ``[get_weather(city="Paris"), f(x=1)]``, and any text after
    the list is content. An output that starts with ``[`` streams its calls
    (``PythonicCalls``: arguments as JSON); one whose first call is none, or that starts
    otherwise, is content."""

    name: ClassVar[str] = "pythonic"
    #: Llama 4 wraps the list in these (``llama4_pythonic``)
    WRAP: ClassVar[tuple[str, str] | None] = None

    def _opens(self, start: str) -> bool | None:
        starts = ("[",) if self.WRAP is None else ("[", self.WRAP[0])
        if any(s.startswith(start) for s in starts):
            return None
        return any(start.startswith(s) for s in starts)

    def _body_start(self, text: str) -> int:
        return len(self.WRAP[0]) if self.WRAP is not None and text.startswith(self.WRAP[0]) else 0

    def _new_region(self) -> PythonicCalls:
        return PythonicCalls(self.WRAP[1] if self.WRAP is not None else "")


@dataclass
class Llama4PythonicToolParser(PythonicToolParser):
    """``pythonic``, the list optionally between ``<|python_start|>`` and ``<|python_end|>``."""

    name: ClassVar[str] = "llama4_pythonic"
    KEEPS_SPECIAL_TOKENS: ClassVar[bool] = True
    WRAP: ClassVar[tuple[str, str] | None] = ("<|python_start|>", "<|python_end|>")


@dataclass
class _HeldAfterMarker(RegionParser):
    """Text streams as content until one of ``MARKS`` could begin; from the marker on,
    the output is the calls' region (``_new_region``)."""

    MARKS: ClassVar[tuple[str, ...]] = ()
    KEEPS_SPECIAL_TOKENS: ClassVar[bool] = True

    def _region_at(self, text: str) -> tuple[int, int | None]:
        found = [(at, mark) for mark in self.MARKS if (at := text.find(mark)) >= 0]
        if found:
            at, mark = min(found)
            return at, at + len(mark)
        return len(text) - max(marker_overlap(text, mark) for mark in self.MARKS), None


class _Segments:
    """Calls one per segment: a head that names the call (``_head``), then its
    arguments object; what follows the object, up to the next ``SEGMENT``, is ignored.
    A segment that is no call ends the calls when none came before it (``failed``: the
    text is content), else only itself."""

    SEGMENT: ClassVar[str] = ""

    def __init__(self, in_segment: bool) -> None:
        self.calls: list[StreamedCall] = []
        self.failed = False
        self.rest = None
        self._text, self._pos, self._state = "", 0, "head" if in_segment else "seek"
        self._current: JsonCall | None = None

    def _head(self, text: str, pos: int) -> tuple[str, int] | None:
        """(the call's name, where its arguments begin) of the head at ``pos``; None
        while it may still come, an empty name (and where to look on) when it is none."""
        raise NotImplementedError

    def _take(self, current: JsonCall) -> None:
        if current.call.ready and (not self.calls or self.calls[-1] is not current.call):
            self.calls.append(current.call)

    def _miss(self, pos: int) -> None:
        self.failed = not self.calls
        self._pos, self._state = pos, "seek"

    def feed(self, more: str) -> None:
        self._text += more
        while not self.failed:
            if self._state == "seek":
                at = self._text.find(self.SEGMENT, self._pos)
                if at < 0:
                    self._pos = max(self._pos, len(self._text) - len(self.SEGMENT) + 1)
                    return
                self._pos, self._state = at + len(self.SEGMENT), "head"
            elif self._state == "head":
                head = self._head(self._text, self._pos)
                if head is None:
                    return
                if not head[0]:
                    self._miss(head[1])
                    continue
                self._current, self._pos, self._state = JsonCall(name=head[0]), head[1], "arguments"
                self._current.feed(self._text[self._pos:])
            else:
                current = self._current
                if len(current.scan.text) < len(self._text) - self._pos:
                    current.feed(self._text[self._pos + len(current.scan.text):])
                self._take(current)
                if current.failed:
                    self._miss(self._pos + current.scan.pos)
                elif current.scan.end is not None or current.wrong:
                    self._pos, self._state = self._pos + (current.scan.end or current.scan.pos), "seek"
                else:
                    return

    def close(self) -> None:
        if self._state == "arguments" and not self.failed:
            self._current.close()
            self._take(self._current)
        self.failed = not self.calls


KEYS = ("arguments", "parameters")


class _MistralSegments(_Segments):
    SEGMENT: ClassVar[str] = "[TOOL_CALLS]"
    ARGS: ClassVar[str] = "[ARGS]"
    CALL_ID: ClassVar[str] = "[CALL_ID]"  # v13 (Small 3.2): name[CALL_ID]id[ARGS]{...}; the id is dropped

    def _head(self, text: str, pos: int) -> tuple[str, int] | None:
        args, brace, segment = text.find(self.ARGS, pos), text.find("{", pos), text.find(self.SEGMENT, pos)
        ends = [(at, at + len(self.ARGS)) for at in (args,) if at >= 0] + [(at, at) for at in (brace,) if at >= 0]
        if not ends:
            return None if segment < 0 else ("", segment)
        cut, start = min(ends)
        return ("", segment) if 0 <= segment < cut else (text[pos:cut].partition(self.CALL_ID)[0].strip(), start)


class _MistralCalls:
    """After the first ``[TOOL_CALLS]``: a JSON array of call objects, or segments."""

    def __init__(self) -> None:
        self._text, self._inner = "", None

    calls = property(lambda self: self._inner.calls if self._inner is not None else [])
    failed = property(lambda self: self._inner is not None and self._inner.failed)
    rest = None  # text after the array is ignored

    def feed(self, more: str) -> None:
        if self._inner is None:
            self._text += more
            head = self._text.lstrip()
            if not head:
                return
            self._inner = JsonCalls("array", KEYS) if head[0] == "[" else _MistralSegments(in_segment=True)
            more = self._text
        self._inner.feed(more)

    def close(self) -> None:
        if self._inner is None:
            self._inner = _MistralSegments(in_segment=True)
        self._inner.close()


def mistral_tool_call_id() -> str:
    """Mistral's ids: nine letters and digits (its chat templates refuse others when the
    call comes back in the next turn)."""
    return uuid.uuid4().hex[:9]


@dataclass
class MistralToolParser(_HeldAfterMarker):
    """Mistral: text, then ``[TOOL_CALLS]`` and the calls: a JSON array of
    ``{"name", "arguments"}`` (tokenizers before v11: Mistral 7B v0.3, Nemo), or
    ``name[ARGS]{...}`` (v11+: Small 3, Magistral; the name runs to ``[ARGS]`` or the
    first ``{``), one ``[TOOL_CALLS]`` per call. Text streams as content until the
    marker could begin (only whitespace before it is held: it is dropped when calls
    follow); a first call that does not parse leaves the whole text as content (vLLM
    keeps only what followed the marker). Ids are Mistral's nine characters."""

    name: ClassVar[str] = "mistral"
    MARKS: ClassVar[tuple[str, ...]] = ("[TOOL_CALLS]",)

    _call_id = staticmethod(mistral_tool_call_id)

    def _region_at(self, text: str) -> tuple[int, int | None]:
        at, body = super()._region_at(text)
        return (0, body) if not self.content and not text[:at].strip() else (at, body)

    def _new_region(self) -> _MistralCalls:
        return _MistralCalls()


class _DeepSeekCalls(_Segments):
    SEGMENT: ClassVar[str] = "<｜tool▁call▁begin｜>"
    SEP: ClassVar[str] = "<｜tool▁sep｜>"
    FENCE: ClassVar[str] = "```json\n"

    def _head(self, text: str, pos: int) -> tuple[str, int] | None:
        sep = text.find("<", pos)  # the kind (function) holds no "<"
        if sep < 0 or self.SEP.startswith(text[sep:]) and not text.startswith(self.SEP, sep):
            return None
        if not text.startswith(self.SEP, sep):
            return "", sep
        line = text.find("\n", sep + len(self.SEP))
        fence = text[line + 1:line + 1 + len(self.FENCE)]
        if line < 0 or len(fence) < len(self.FENCE) and self.FENCE.startswith(fence):
            return None
        name = text[sep + len(self.SEP):line].strip()
        return (name, line + 1 + len(fence)) if fence == self.FENCE else ("", line)


@dataclass
class DeepSeekV3ToolParser(_HeldAfterMarker):
    """DeepSeek V3 / R1: ``<｜tool▁calls▁begin｜>`` then per call
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and its arguments in a json
    code block, ``<｜tool▁call▁end｜>``. Arguments may span lines (vLLM's pattern
    takes one-line arguments only)."""

    name: ClassVar[str] = "deepseek_v3"
    MARKS: ClassVar[tuple[str, ...]] = ("<｜tool▁calls▁begin｜>",)

    def _new_region(self) -> _DeepSeekCalls:
        return _DeepSeekCalls(in_segment=False)


@dataclass
class GraniteToolParser(_HeldAfterMarker):
    """Granite 3.0 / 3.1: ``<|tool_call|>`` (3.0, a special token) or ``<tool_call>``
    (3.1, text), then a JSON array of ``{"name", "arguments"}`` (or one object); prose
    after it is content too."""

    name: ClassVar[str] = "granite"
    MARKS: ClassVar[tuple[str, ...]] = ("<|tool_call|>", "<tool_call>")

    def _new_region(self) -> JsonCalls:
        return JsonCalls("any", KEYS)


class _InternLMCalls:
    """The action's text: one call object from its first ``{``; what follows is ignored."""

    END: ClassVar[str] = "<|action_end|>"

    def __init__(self) -> None:
        self._text, self._inner = "", None
        self.failed = False

    calls = property(lambda self: self._inner.calls if self._inner is not None else [])
    rest = None

    def feed(self, more: str) -> None:
        if self._inner is not None:
            return self._inner.feed(more)
        self._text += more
        brace, end = self._text.find("{"), self._text.find(self.END)
        if 0 <= end and (brace < 0 or end < brace):
            self.failed = True
        elif brace >= 0:
            self._inner = JsonCalls("one", ("parameters", "arguments"))
            self._inner.feed(self._text[brace:])

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        self.failed = self.failed or not self.calls


@dataclass
class InternLMToolParser(_HeldAfterMarker):
    """InternLM 2 / 2.5: ``<|action_start|><|plugin|>`` then one JSON object
    ``{"name", "parameters"}`` (or ``"arguments"``) up to ``<|action_end|>``."""

    name: ClassVar[str] = "internlm"
    MARKS: ClassVar[tuple[str, ...]] = ("<|action_start|><|plugin|>",)

    def _new_region(self) -> _InternLMCalls:
        return _InternLMCalls()


@dataclass
class HarmonyToolParser(ToolCallParser):
    """gpt-oss (``openai``): harmony messages addressed to ``functions.NAME``
    (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``)
    are calls, streamed as their arguments object arrives; one whose body is no
    arguments object is content as written. ``final`` and ``commentary`` messages to no
    one are content, ``analysis`` is left to the reasoning parser (dropped here), and so
    are messages to other recipients (built-in tools). Under the ``openai_gptoss``
    reasoning parser the calls reach this parser as the model wrote them. The messages
    are ``HarmonySplit``'s, which passes recipient messages on as written."""

    name: ClassVar[str] = "openai"
    KEEPS_SPECIAL_TOKENS: ClassVar[bool] = True
    HEADERS: ClassVar[tuple[str, ...]] = ("<|start|>", "<|channel|>", "<|constrain|>")
    ENDS: ClassVar[tuple[str, ...]] = ("<|call|>", "<|end|>", "<|return|>")

    _split: HarmonySplit = field(default_factory=lambda: HarmonySplit(raw_calls=True))
    _out: str = ""  # the split's output not yet read
    _message: str | None = None  # the recipient message being read, as written
    _function: str | None = None  # the function it calls (None: another recipient)
    _body: JsonCall | None = None
    _at_start: bool = True  # the output may begin inside the prompt's "<|start|>assistant" header

    def _end_message(self) -> Emitted:
        message, function, body = self._message, self._function, self._body
        self._message = self._function = self._body = None
        if function is None:
            return "", []
        if body is not None:
            body.close()
            if body.call.ready:
                return "", self._pieces(body.call)
        return message or "", []

    def _read(self, out: str, final: bool = False) -> Emitted:
        self._out += out
        content, deltas = "", []
        while self._out:
            if self._message is None:
                at = min((i for i in map(self._out.find, self.HEADERS) if i >= 0), default=-1)
                if self._at_start:  # " to=functions.f<|channel|>...": the recipient in the role header
                    head = self._out.lstrip()
                    if head.startswith("to=") or len(head) < 3 and "to=".startswith(head):
                        at = 0  # the header (or too short to tell), held until its <|message|>
                    else:
                        self._at_start = False
                begins = self._out.find("<|message|>", max(at, 0))
                if at < 0 or begins < 0:
                    content, self._out = content + self._out[:at if at >= 0 else None], self._out[at:] if at >= 0 else ""
                    break
                content, self._at_start = content + self._out[:at], False
                header, self._out = self._out[at:begins], self._out[begins + len("<|message|>"):]
                self._message = header + "<|message|>"
                recipient = re.search(r"to=([^\s<]+)", header)
                self._function = recipient.group(1).removeprefix("functions.") if recipient and \
                    recipient.group(1).startswith("functions.") else None
                self._body = JsonCall(name=self._function) if self._function else None
                continue
            at, token = min(((i, t) for t in self.ENDS if (i := self._out.find(t)) >= 0),
                            default=(len(self._out), ""))
            self._message += self._out[:at] + token
            if self._body is not None:
                self._body.feed(self._out[:at])
                deltas += self._pieces(self._body.call)
            self._out = self._out[at + len(token):]
            if not token:
                break
            more, new = self._end_message()
            content, deltas = content + more, deltas + new
        if final:
            if self._message is not None:
                more, new = self._end_message()
                content, deltas = content + more, deltas + new
            content, self._out = content + self._out, ""
        return content, deltas

    def feed(self, text: str) -> Emitted:
        return self._emit(*self._read(self._split.feed(text)[1]))

    def finish(self) -> Emitted:
        self.finished = True
        return self._emit(*self._read(self._split.finish()[1], final=True))
