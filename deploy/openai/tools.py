"""Tool calling on the chat endpoint, as vLLM does it.

``ToolPlan.of(request, options)`` checks a request's ``tools`` and ``tool_choice`` and
decides what happens:

- ``"none"``: the tools are rendered into the prompt (unless the server excludes them),
  the answer is plain text, never parsed.
- ``"auto"`` (the default when tools are given): the model writes calls in its own
  format and the server's parser (``--tool-call-parser``; ``--enable-auto-tool-choice``
  must be set, as in vLLM) finds them.
- a named function: the output is constrained to that function's ``parameters``
  schema and becomes one call to it.
- ``"required"``: the output is constrained to a JSON array of
  ``{"name": <a tool>, "parameters": <its schema>}`` objects (``anyOf`` over the tools;
  at most one with ``parallel_tool_calls: false``), which become the calls.

It also gives what the chat template gets (``tools=``, and the conversation with
assistant ``tool_calls`` arguments as dicts) and one ``ToolCallParser`` per choice.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deploy.openai.errors import RequestError
from deploy.openai.structured import Constraint, check_json_schema, with_defaults
from deploy.openai.tool_parser_names import TOOL_PARSERS
from deploy.openai.tool_parsers import NamedFunctionParser, PlainParser, RequiredCallsParser, ToolCallParser

#: Default bound on the tools of one request (``ServerArgs.max_tools``).
DEFAULT_MAX_TOOLS = 128


@dataclass(frozen=True)
class ApiOptions:
    """What the server's configuration adds to a request's own fields."""

    #: JSON options for constraints whose request did not set them (vLLM's
    #: ``--structured-outputs-config``): disable_any_whitespace, disable_additional_properties
    structured_defaults: Mapping[str, Any] = field(default_factory=dict)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    #: the engine's ``reasoning_parser`` (chat answers split their reasoning off), and
    #: whether its markers are special tokens of the model's tokenizer (the text must
    #: keep special tokens to show them)
    reasoning_parser: str | None = None
    reasoning_special_tokens: bool = False
    max_tools: int = DEFAULT_MAX_TOOLS
    exclude_tools_when_tool_choice_none: bool = False
    #: characters the rendered prompt may hold (tools and call arguments beyond it
    #: cannot fit, and are refused before the template runs); None: no check
    max_prompt_chars: int | None = None


def parse_arguments(arguments: Any) -> dict[str, Any]:
    """An assistant message's tool call arguments as the dict chat templates expect
    (OpenAI clients send a JSON string); anything that is not an object becomes
    ``{}``, as vLLM does, so a bad turn in the history does not fail every later one."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _params_or_empty(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


def _relocate_refs(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` ("#/$defs/X", "#") pointing where the
    schema now sits (``base``, a JSON pointer fragment), so a tool's definitions keep
    working inside the required-calls array."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and (len(ref) == 1 or ref[1] == "/"):
                node["$ref"] = base + ref[1:]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def required_calls_schema(tools: list[Any], single: bool) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array (at most one
    item when ``single``) of ``{"name": <one tool's name>, "parameters": <its
    schema>}``, with nothing else in each object."""
    variants = []
    for i, tool in enumerate(tools):
        parameters = _relocate_refs(copy.deepcopy(_params_or_empty(tool.function.parameters)),
                                    f"#/items/anyOf/{i}/properties/parameters")
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if single:
        schema["maxItems"] = 1
    return schema


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and its answer."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[Any] | None = None  # the request's ChatTool models
    function: str | None = None  # the named function
    parser: str | None = None  # for "auto"
    single_call: bool = False  # parallel_tool_calls: false
    exclude_from_prompt: bool = False

    @classmethod
    def of(cls, body: Any, options: ApiOptions) -> ToolPlan:
        """The plan of ``body`` (a ChatCompletionRequest); a ``RequestError`` naming
        the field for anything the server cannot do with it."""
        tools, choice = body.tools, body.tool_choice
        if tools is not None:
            cls.check_tools(tools, options)
        if choice is None:
            choice = "auto" if tools else "none"
        single = body.parallel_tool_calls is False
        if choice == "none":
            return cls("none", tools, exclude_from_prompt=options.exclude_tools_when_tool_choice_none)
        if not tools:
            raise RequestError("tool_choice: needs tools (only \"none\" is allowed without them)", "tool_choice")
        if choice == "auto":
            if not options.enable_auto_tool_choice or options.tool_call_parser is None:
                raise RequestError('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                   "--tool-call-parser to be set (tools given without tool_choice mean \"auto\")",
                                   "tool_choice")
            return cls("auto", tools, parser=options.tool_call_parser, single_call=single)
        if choice == "required":
            return cls("required", tools, single_call=single)
        name = choice.function.name
        if not any(t.function.name == name for t in tools):
            raise RequestError(f"tool_choice: the function {name!r} is not one of the tools", "tool_choice")
        return cls("named", tools, function=name, single_call=single)

    @staticmethod
    def check_tools(tools: list[Any], options: ApiOptions) -> None:
        if not tools:
            raise RequestError("tools must not be empty (leave the field out instead)", "tools")
        if len(tools) > options.max_tools:
            raise RequestError(f"tools: {len(tools)} tools is more than the server's max_tools={options.max_tools}",
                               "tools")
        seen: dict[str, int] = {}
        for i, tool in enumerate(tools):
            name = tool.function.name
            if name in seen:
                raise RequestError(f"tools[{i}].function.name: {name!r} is already tools[{seen[name]}]'s name",
                                   f"tools[{i}].function.name")
            seen[name] = i
            if tool.function.parameters is not None:
                check_json_schema(tool.function.parameters, f"tools[{i}].function.parameters")

    # -- the prompt ------------------------------------------------------------------

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools=`` for the chat template: OpenAI's shape, as transformers expects."""
        if not self.tools or self.exclude_from_prompt:
            return None
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]

    # -- the constraint --------------------------------------------------------------

    def constraint(self, request_constraint: Constraint | None, options: Mapping[str, Any],
                   defaults: Mapping[str, Any]) -> Constraint | None:
        """The output's constraint: the request's own (``response_format``, ...), or
        the one a named function or ``"required"`` needs; both at once is a 400.
        ``options`` are JSON options the request gave without a constraint."""
        if self.mode not in ("named", "required"):
            return request_constraint
        if request_constraint is not None:
            raise RequestError(f"tool_choice {self.choice_text()} and {request_constraint.source} both constrain the "
                               "output; give only one", "tool_choice")
        if self.mode == "named":
            i, tool = next((i, t) for i, t in enumerate(self.tools) if t.function.name == self.function)
            spec = {"json": _params_or_empty(tool.function.parameters)}
            if tool.function.strict:  # OpenAI's strict mode: no properties the schema does not list
                spec["disable_additional_properties"] = True
            return Constraint(with_defaults({**options, **spec}, defaults), "tools", f"tools[{i}].function.parameters")
        spec = {"json": required_calls_schema(self.tools, self.single_call)}
        if any(t.function.strict for t in self.tools):  # closes every tool's objects: still valid for all
            spec["disable_additional_properties"] = True
        parts = [(f"tools[{i}].function.parameters", {"json": _params_or_empty(t.function.parameters)})
                 for i, t in enumerate(self.tools)]
        return Constraint(with_defaults({**options, **spec}, defaults), "tools", "tools", parts)

    def choice_text(self) -> str:
        return json.dumps(self.function) if self.mode == "named" else json.dumps(self.mode)

    # -- the answer ------------------------------------------------------------------

    def parser_for_choice(self) -> ToolCallParser:
        if self.mode == "named":
            return NamedFunctionParser(function=self.function)
        if self.mode == "required":
            return RequiredCallsParser(single_call=self.single_call)
        if self.mode == "auto":
            schemas = {t.function.name: t.function.parameters for t in self.tools or ()}
            return TOOL_PARSERS[self.parser](single_call=self.single_call, schemas=schemas)
        return PlainParser()

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        """As vLLM (and OpenAI): "tool_calls" when an "auto" or "required" answer that
        called a tool stopped by itself; a named function's answer keeps "stop"."""
        if called and finish_reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def empty_content(self) -> str | None:
        """The message content of an answer that is only calls: vLLM sends "" for a
        named function or "required", null for "auto"."""
        return "" if self.mode in ("named", "required") else None
