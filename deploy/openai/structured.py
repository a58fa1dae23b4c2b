"""Structured outputs at the HTTP edge: OpenAI's ``response_format``, vLLM's
``structured_outputs`` extra and the legacy ``guided_*`` fields become one
``StructuredOutputsParams`` spec (a dict of its fields), remembered with the request
field it came from so that every error about it names that field.

The worker enforces the constraint (``worker/structured_output.py``); the
engine compiles it when the request is made (``ValueError`` "structured_outputs.<field>
is invalid: ..."). Here: which field constrains the output (at most one of them), JSON
schemas checked against their meta-schema (a 400 naming the field before anything is
compiled), the server's defaults for the JSON options, and the engine's messages
renamed to the client's field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from deploy.openai.errors import RequestError, not_supported
from sampler.params import MAX_SCHEMA_DEPTH, json_depth

#: StructuredOutputsParams fields that are the constraint itself (exactly one).
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
#: The JSON options a server may default (vLLM's ``--structured-outputs-config``).
DEFAULTABLE_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")
#: vLLM's legacy request fields (removed in vLLM 0.12; honoured here) -> the field.
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}

_ENGINE_PREFIX = re.compile(r"^structured_outputs(\.[a-z_]+)?")


def check_json_schema(schema: Any, where: str, param: str | None = None) -> None:
    """A 400 naming ``where`` unless ``schema`` is a JSON schema object that its
    meta-schema accepts (the draft its ``$schema`` names; 2020-12 when it names none).
    ``pattern`` regexes are left to the grammar compiler, whose regex dialect is the
    one that counts (Python's ``re`` refuses valid ECMA-262 classes such as ``\\p{L}``)."""
    param = param or where
    if not isinstance(schema, dict):
        raise RequestError(f"{where} must be a JSON schema object, got {type(schema).__name__}", param)
    if json_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise RequestError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
    declared = schema.get("$schema")
    if declared is not None and not isinstance(declared, str):
        raise RequestError(f"{where}: $schema must be a string (a meta-schema URI)", param)
    try:
        validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as exc:
        at = "".join(f"[{p!r}]" for p in exc.absolute_path)
        message = exc.message if len(exc.message) <= 300 else exc.message[:300] + "..."
        raise RequestError(f"{where} is not a valid JSON schema{' at ' + at if at else ''}: {message}", param) from None
    except Exception as exc:  # hostile input: whatever the checker trips on is the schema's fault
        raise RequestError(f"{where} cannot be checked as a JSON schema: {type(exc).__name__}", param) from None


@dataclass
class Constraint:
    """A request's constraint on its output: the ``StructuredOutputsParams`` fields,
    the request field it came from (``source``) and the path of what it constrains
    with (``where``), which every error message about it names."""

    spec: dict[str, Any]
    source: str
    where: str
    #: (where, spec) of the pieces it was built from, to tell which one is at fault
    #: when the whole does not compile (each tool of the required-calls schema)
    parts: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def explain(self, exc: ValueError) -> tuple[str, str | None] | None:
        """(message, param) for an error the engine raised about this constraint
        ("structured_outputs.json is invalid: ..."), named as the client named it;
        None when the error is about something else."""
        message = str(exc)
        if not _ENGINE_PREFIX.match(message):
            return None
        if self.source == "structured_outputs":
            return message, message.split(" ", 1)[0].rstrip(":")
        return _ENGINE_PREFIX.sub(self.where, message, count=1), self.where


def with_defaults(spec: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with the server's JSON options where the request set none."""
    out = dict(spec)
    if out.get("json") is not None or out.get("json_object"):
        for key in DEFAULTABLE_OPTIONS:
            if key in defaults and key not in out:
                out[key] = defaults[key]
    return out


def request_constraint(response_format: Any, structured_outputs: dict[str, Any] | None,
                       legacy: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[Constraint | None, dict[str, Any]]:
    """The constraint a request's own fields set (at most one of ``response_format``,
    ``structured_outputs`` and the ``guided_*`` fields may set one: two are a 400), and
    the JSON options given without a constraint (``structured_outputs`` holding only
    ``disable_any_whitespace``, say), which apply to a constraint built from tools."""
    found: list[Constraint] = []
    options: dict[str, Any] = {}
    if response_format is not None and response_format.type != "text":
        kind = response_format.type
        if kind == "json_object":
            found.append(Constraint({"json_object": True}, "response_format", "response_format"))
        elif kind == "json_schema":
            holder = response_format.json_schema
            schema = None if holder is None else holder.schema_
            if schema is None:
                raise RequestError("response_format: type json_schema needs json_schema.schema", "response_format")
            where = "response_format.json_schema.schema"
            check_json_schema(schema, where)
            spec: dict[str, Any] = {"json": schema}
            if holder.strict:  # OpenAI's strict mode: objects never get properties they do not list
                spec["disable_additional_properties"] = True
            found.append(Constraint(spec, "response_format", where))
        else:
            raise not_supported("response_format", f"type {kind!r} is not supported (structural tags are not "
                                                   "implemented; use json_schema, json_object or text)")
    if structured_outputs is not None:
        so = dict(structured_outputs)
        if so.get("structural_tag") is not None:
            raise not_supported("structured_outputs.structural_tag", "structural tags are not supported yet")
        so.pop("structural_tag", None)
        if any(so.get(k) is not None for k in CONSTRAINT_KEYS):
            schema = so.get("json")
            if isinstance(schema, dict):
                check_json_schema(schema, "structured_outputs.json")
            found.append(Constraint(so, "structured_outputs", "structured_outputs"))
        elif so:
            options = so  # options only: they shape a constraint set elsewhere
        else:
            raise RequestError(f"structured_outputs must set one of {', '.join(CONSTRAINT_KEYS)}", "structured_outputs")
    for name, key in LEGACY_FIELDS.items():
        value = legacy.get(name)
        if value is not None:
            if key == "json" and isinstance(value, dict):
                check_json_schema(value, name)
            spec = {key: value}
            if legacy.get("guided_whitespace_pattern") is not None and key == "json":
                spec["whitespace_pattern"] = legacy["guided_whitespace_pattern"]
            found.append(Constraint(spec, name, name))
    if len(found) > 1:
        raise RequestError(f"{found[0].source} and {found[1].source} both constrain the output; give only one",
                           found[1].source)
    if not found:
        return None, options
    constraint = found[0]
    constraint.spec = with_defaults({**options, **constraint.spec} if options else constraint.spec, defaults)
    return constraint, {}
