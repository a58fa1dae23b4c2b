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
whose streaming this shares: a call is sent whole once its end tag (or the output's
end) arrives; a parameter cut off by the end of the output is dropped.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, ClassVar

from deploy.openai.tool_parsers import HermesToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
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


class Qwen3XmlToolParser(HermesToolParser):
    name: ClassVar[str] = "qwen3_xml"

    def _parse_body(self, body: str) -> tuple[str, str] | None:
        match = _FUNCTION.search(body)
        if match is None or not match.group(1).strip():
            return None
        name = match.group(1).strip()
        schema = self.schemas.get(name)
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        arguments = {}
        for key, value in _PARAMETER.findall(match.group(2)):
            key = key.strip()
            arguments[key] = coerce(_trim(value), schema_types(properties.get(key)))
        try:
            return name, json.dumps(arguments, ensure_ascii=False)
        except (ValueError, RecursionError):
            return None
