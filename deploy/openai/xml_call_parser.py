"""Qwen3-Coder's XML tool calls (``--tool-call-parser qwen3_xml`` or ``qwen3_coder``, as
vLLM names them)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each parameter's value is text (one newline at each end is the template's); it becomes
the type the tool's schema gives that parameter (``coerce``: null, integer, number,
boolean, object, array, string, in that order of preference, as vLLM's), a string
where the schema says nothing. Text around the calls is content, as with ``hermes``,
whose streaming this shares (``XmlCall`` reads the text between the tags): a call is
announced at its ``<function=NAME>`` (nothing after it can make it no call), then each
parameter is sent as it closes, as the next pair of the arguments JSON; a parameter
cut off by the end of the output (or by ``</function>``) is dropped, and a repeated
one is ignored (the first stands: it was sent).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, ClassVar

from deploy.openai.call_stream import StreamedCall
from deploy.openai.tool_parsers import HermesToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_ALIASES = {"str": "string", "text": "string", "int": "integer", "float": "number", "double": "number",
            "bool": "boolean", "dict": "object", "list": "array"}


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows (its ``type``, its ``enum``'s values'
    types, its ``anyOf``/``oneOf``/``allOf`` branches); ``{"string"}`` when it says none."""
    types: set[str] = set()
    if isinstance(schema, dict):
        kind = schema.get("type")
        for t in kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []:
            if isinstance(t, str):
                types.add(_ALIASES.get(t.strip().lower(), t.strip().lower()))
        for value in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
            types.add("null" if value is None else "boolean" if isinstance(value, bool) else
                      "integer" if isinstance(value, int) else "number" if isinstance(value, float) else
                      "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "string")
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(schema.get(key), list):
                for branch in schema[key]:
                    types |= schema_types(branch)
    return types or {"string"}


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def coerce(text: str, types: set[str]) -> Any:
    """``text`` as the first of ``types`` (in ``_ORDER``) it reads as; else as JSON,
    else the text."""
    for kind in _ORDER:
        if kind not in types:
            continue
        if kind == "string":
            return text
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and text.strip().lower() in ("true", "1", "false", "0"):
            return text.strip().lower() in ("true", "1")
        if kind in ("object", "array"):
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                continue
            if _finite(value):
                return value
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if _finite(value) else text


def _trim(value: str) -> str:
    """One newline off each end (the template's framing)."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


class XmlCall:
    """One call's text between the tags as it arrives: its name from the first
    ``<function=NAME>`` (a blank one: no call), then each
    ``<parameter=KEY>VALUE</parameter>`` as it closes, up to ``</function>``; text
    between the parameters is ignored."""

    def __init__(self, schemas: dict[str, Any]) -> None:
        self.schemas = schemas
        self.call = StreamedCall(early=True)
        self.failed = False
        self._text, self._pos = "", 0
        self._end: int | None = None  # where the function's body ends (``</function>``)
        self._properties: dict[str, Any] = {}

    def feed(self, more: str) -> None:
        self._text += more
        if ">" in more and not (self.failed or self.call.closed):  # every tag read here ends with ">"
            self._scan()

    def _scan(self) -> None:
        text = self._text
        if self.call.name is None:
            match = _FUNCTION.search(text, self._pos)
            if match is None:
                return
            self.call.name, self._pos = match.group(1).strip(), match.end()
            if not self.call.name:
                self.failed, self.call.name = True, None
                return
            schema = self.schemas.get(self.call.name)
            properties = schema.get("properties") if isinstance(schema, dict) else None
            self._properties = properties if isinstance(properties, dict) else {}
        if self._end is None and (end := text.find("</function>", self._pos)) >= 0:
            self._end = end
        while not self.call.closed and (match := _PARAMETER.search(text, self._pos, self._end or len(text))):
            key = match.group(1).strip()
            if not self.call.add(key, coerce(_trim(match.group(2)), schema_types(self._properties.get(key)))):
                self.call.close()
            self._pos = match.end()
        if self._end is not None:
            self.call.close()

    def close(self) -> None:
        """The call's text ended."""
        if self.call.name is None:
            self.failed = True
        self.call.close()


class Qwen3XmlToolParser(HermesToolParser):
    name: ClassVar[str] = "qwen3_xml"

    def _new_body(self) -> XmlCall:
        return XmlCall(self.schemas)
