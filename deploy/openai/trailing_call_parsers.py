"""Tool call formats whose calls run to the end of the output, so a stream holds them
until it ends: ``PythonicToolParser`` (``pythonic``: Llama 3.2 / ToolACE's Python list of
calls; ``llama4_pythonic``: the same between Llama 4's python tags) and
``MistralToolParser`` (``mistral``: ``[TOOL_CALLS]`` and a JSON array, or
``name[ARGS]{...}`` per call from tokenizer v11), ``DeepSeekV3ToolParser``
(``deepseek_v3``), ``GraniteToolParser`` (``granite``), ``InternLMToolParser``
(``internlm``) and ``HarmonyToolParser`` (``openai``: gpt-oss). Text before them streams as content.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from cluster.reasoning_parsers import HarmonySplit
from deploy.openai.tool_parsers import (
    DecidedByStart,
    Emitted,
    ToolCallDelta,
    ToolCallParser,
    marker_overlap,
    new_tool_call_id,
    parse_call_object,
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


def _dotted(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        inner = _dotted(func.value)
        return None if inner is None else f"{inner}.{func.attr}"
    return None


def parse_pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """``[f(a=1), g.h(b="x")]`` as (name, arguments JSON) pairs; None unless the whole
    text is one such list (keyword arguments with JSON values only, as vLLM's pattern)."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for call in tree.body.elts:
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            return None
        name = _dotted(call.func)
        if name is None:
            return None
        try:
            arguments = {k.arg: _literal(k.value) for k in call.keywords}
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        except (_NotLiteral, ValueError, RecursionError):
            return None
    return calls


@dataclass
class PythonicToolParser(DecidedByStart):
    """Llama 3.2 / Llama 4 / ToolACE pythonic calls: the whole output is a Python list
    of keyword-argument calls, ``[get_weather(city="Paris"), f(x=1)]``. An output that
    starts with ``[`` is held until it ends and then parsed (arguments as JSON); one
    that is not such a list, or starts otherwise, is content."""

    name: ClassVar[str] = "pythonic"
    #: Llama 4 wraps the list in these (``llama4_pythonic``)
    WRAP: ClassVar[tuple[str, str] | None] = None

    def _opens(self, start: str) -> bool | None:
        starts = ("[",) if self.WRAP is None else ("[", self.WRAP[0])
        if any(s.startswith(start) for s in starts):
            return None
        return any(start.startswith(s) for s in starts)

    def finish(self) -> Emitted:
        self.finished = True
        text, self._buf = self._buf, ""
        if self._mode != "calls":
            return self._emit(text, [])
        body = text
        if self.WRAP is not None and body.startswith(self.WRAP[0]):
            body = body[len(self.WRAP[0]):].replace(self.WRAP[1], "")
        calls = parse_pythonic_calls(body)
        if calls is None:
            return self._emit(text, [])
        return self._emit("", [ToolCallDelta(i, arguments, new_tool_call_id(), name)
                               for i, (name, arguments) in enumerate(calls)])


@dataclass
class _HeldAfterMarker(ToolCallParser):
    """Text streams as content until one of ``MARKS`` could begin; from the marker on,
    the output is held until it ends and then parsed by ``_parse`` (None: all of it
    stays content)."""

    MARKS: ClassVar[tuple[str, ...]] = ()
    KEEPS_SPECIAL_TOKENS: ClassVar[bool] = True
    #: the held text's parsed content stands even when it holds no call (harmony's
    #: markers frame every message, not only calls)
    FRAMES_CONTENT: ClassVar[bool] = False

    _buf: str = ""
    _held: bool = False

    def feed(self, text: str) -> Emitted:
        self._buf += text
        if self._held:
            return self._emit("", [])
        found = [(at, mark) for mark in self.MARKS if (at := self._buf.find(mark)) >= 0]
        if found:
            at = min(found)[0]
            out, self._buf, self._held = self._buf[:at], self._buf[at:], True
            return self._emit(out, [])
        keep = max(marker_overlap(self._buf, mark) for mark in self.MARKS)
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return self._emit(out, [])

    def _parse(self, held: str) -> tuple[str, list[tuple[str, str]]] | None:
        """(content after the calls, [(name, arguments JSON)]) of the held text."""
        raise NotImplementedError

    @staticmethod
    def _call_id() -> str:
        return new_tool_call_id()

    def finish(self) -> Emitted:
        self.finished = True
        text, self._buf = self._buf, ""
        parsed = self._parse(text) if self._held else None
        if parsed is None or not (parsed[1] or self.FRAMES_CONTENT):
            return self._emit(text, [])
        after, calls = parsed
        return self._emit(after, [ToolCallDelta(i, arguments, self._call_id(), name)
                                  for i, (name, arguments) in enumerate(calls)])


def mistral_tool_call_id() -> str:
    """Mistral's ids: nine letters and digits (its chat templates refuse others when the
    call comes back in the next turn)."""
    return uuid.uuid4().hex[:9]


@dataclass
class MistralToolParser(_HeldAfterMarker):
    """Mistral: text, then ``[TOOL_CALLS]`` and the calls: a JSON array of
    ``{"name", "arguments"}`` (tokenizers before v11: Mistral 7B v0.3, Nemo), or
    ``name[ARGS]{...}`` (v11+: Small 3, Magistral), one ``[TOOL_CALLS]`` per call.
    Text streams as content until the marker could begin; the calls are held until the
    output ends, then parsed. Calls that do not parse leave the whole text as content
    (vLLM keeps only what followed the marker). Ids are Mistral's nine characters."""

    name: ClassVar[str] = "mistral"
    MARKS: ClassVar[tuple[str, ...]] = ("[TOOL_CALLS]",)
    ARGS: ClassVar[str] = "[ARGS]"

    _call_id = staticmethod(mistral_tool_call_id)

    def _calls(self, tail: str) -> list[tuple[str, str]] | None:
        segments = [s.strip() for s in tail.split(self.MARKS[0]) if s.strip()]
        if not segments:
            return None
        if segments[0].startswith("["):  # before v11: one JSON array
            try:
                parsed, _ = json.JSONDecoder().raw_decode(segments[0])
            except (ValueError, RecursionError):
                return None
            items = parsed if isinstance(parsed, list) else [parsed]
            calls = [parse_call_object(item, ("arguments", "parameters")) for item in items]
            return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]
        calls = []
        for segment in segments:  # v11+: name[ARGS]{...}, or name{...}
            name, sep, arguments = segment.partition(self.ARGS)
            if not sep:
                brace = segment.find("{")
                if brace < 0:
                    return None
                name, arguments = segment[:brace], segment[brace:]
            try:
                value, _ = json.JSONDecoder().raw_decode(arguments.strip())
            except (ValueError, RecursionError):
                return None
            call = parse_call_object({"name": name.strip(), "arguments": value}, ("arguments",))
            if call is None:
                return None
            calls.append(call)
        return calls

    def _parse(self, held: str) -> tuple[str, list[tuple[str, str]]] | None:
        calls = self._calls(held[len(self.MARKS[0]):])
        return None if calls is None else ("", calls)

    def finish(self) -> Emitted:
        emitted = super().finish()
        if self.calls and not self.content.strip():
            self.content = ""  # only whitespace before the calls: no content (vLLM)
        return emitted


@dataclass
class Llama4PythonicToolParser(PythonicToolParser):
    """``pythonic``, the list optionally between ``<|python_start|>`` and ``<|python_end|>``."""

    name: ClassVar[str] = "llama4_pythonic"
    KEEPS_SPECIAL_TOKENS: ClassVar[bool] = True
    WRAP: ClassVar[tuple[str, str] | None] = ("<|python_start|>", "<|python_end|>")


_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<kind>[^<]*)<｜tool▁sep｜>(?P<name>[^\n]*)\n```json\n(?P<arguments>.*?)\n```"
    r"<｜tool▁call▁end｜>", re.DOTALL)


@dataclass
class DeepSeekV3ToolParser(_HeldAfterMarker):
    """DeepSeek V3 / R1: ``<｜tool▁calls▁begin｜>`` then per call
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and its arguments in a json
    code block, ``<｜tool▁call▁end｜>``. Arguments may span lines (vLLM's pattern
    takes one-line arguments only)."""

    name: ClassVar[str] = "deepseek_v3"
    MARKS: ClassVar[tuple[str, ...]] = ("<｜tool▁calls▁begin｜>",)

    def _parse(self, held: str) -> tuple[str, list[tuple[str, str]]] | None:
        calls = []
        for match in _DEEPSEEK_CALL.finditer(held):
            call = parse_call_object({"name": match["name"].strip(), "arguments": match["arguments"].strip()},
                                     ("arguments",))
            if call is None:
                return None
            calls.append(call)
        return "", calls


@dataclass
class GraniteToolParser(_HeldAfterMarker):
    """Granite 3.0 / 3.1: ``<|tool_call|>`` (3.0, a special token) or ``<tool_call>``
    (3.1, text), then a JSON array of ``{"name", "arguments"}``; prose after the array
    is content too."""

    name: ClassVar[str] = "granite"
    MARKS: ClassVar[tuple[str, ...]] = ("<|tool_call|>", "<tool_call>")

    def _parse(self, held: str) -> tuple[str, list[tuple[str, str]]] | None:
        mark = next(m for m in self.MARKS if held.startswith(m))
        body = held[len(mark):].lstrip()
        try:
            parsed, end = json.JSONDecoder().raw_decode(body)
        except (ValueError, RecursionError):
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [parse_call_object(item, ("arguments", "parameters")) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return body[end:].strip(), calls  # type: ignore[return-value]


@dataclass
class InternLMToolParser(_HeldAfterMarker):
    """InternLM 2 / 2.5: ``<|action_start|><|plugin|>`` then one JSON object
    ``{"name", "parameters"}`` (or ``"arguments"``) up to ``<|action_end|>``."""

    name: ClassVar[str] = "internlm"
    MARKS: ClassVar[tuple[str, ...]] = ("<|action_start|><|plugin|>",)

    def _parse(self, held: str) -> tuple[str, list[tuple[str, str]]] | None:
        action = held[len(self.MARKS[0]):].split("<|action_end|>")[0]
        brace = action.find("{")
        call = parse_call_object(action[brace:].strip(), ("parameters", "arguments")) if brace >= 0 else None
        return None if call is None else ("", [call])


@dataclass
class HarmonyToolParser(_HeldAfterMarker):
    """gpt-oss (``openai``): harmony messages addressed to ``functions.NAME``
    (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``)
    are calls; ``final`` and ``commentary`` messages to no one are content, ``analysis``
    is left to the reasoning parser (dropped here), and so are messages to other
    recipients (built-in tools). Under the ``openai_gptoss`` reasoning parser the
    calls reach this parser as the model wrote them."""

    name: ClassVar[str] = "openai"
    MARKS: ClassVar[tuple[str, ...]] = ("<|start|>", "<|channel|>")
    FRAMES_CONTENT: ClassVar[bool] = True

    def _parse(self, held: str) -> tuple[str, list[tuple[str, str]]] | None:
        split = HarmonySplit(raw_calls=False)
        content = split.feed(held)[1] + split.finish()[1]
        calls = []
        for recipient, _, body in split.calls:
            if not recipient.startswith("functions."):
                continue
            call = parse_call_object({"name": recipient[len("functions."):], "arguments": body.strip()},
                                     ("arguments",))
            if call is None:
                return None
            calls.append(call)
        return content, calls
