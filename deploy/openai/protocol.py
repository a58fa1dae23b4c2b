"""The OpenAI HTTP API's request bodies (with vLLM's extra fields) and how they map to
``SamplingParams``. The responses are built in ``serving_completion`` and
``serving_chat``; every string of a body is checked first (``text_validation``).

vLLM's OpenAI server is the contract. Unknown request fields are ignored, as vLLM does
(each name logged once, at debug). Known fields that would change the result but are
not implemented (yet) are a 400 naming the field: every request model lists them in
``unsupported()``. The whole request -> ``SamplingParams`` mapping is
``SamplingFields.sampling_params`` (shared fields) plus each endpoint's
``_endpoint_params`` (max_tokens, logprobs, prompt logprobs): a new sampling feature
goes there and nowhere else.

Logprobs keep each endpoint's own shape: completions take ``logprobs: int`` (top-n per
token, and with ``echo`` the prompt's tokens first); chat takes ``logprobs: bool`` plus
``top_logprobs``. Both take vLLM's ``prompt_logprobs``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from cluster.reasoning_parsers import ReasoningParserSpec, reasoning_parser
from deploy.openai.errors import RequestError, not_supported
from deploy.openai.structured import Constraint, request_constraint
from deploy.openai.text_validation import TextOnlyModel, printable
from deploy.openai.tool_parser_names import TOOL_PARSERS
from deploy.openai.tools import ApiOptions, ToolPlan, parse_arguments
from sampler.params import RequestOutputKind, SamplingParams

logger = logging.getLogger("raydecode")


#: Ignored field names already logged (bounded: a client can invent any number).
_LOGGED_IGNORED: set[str] = set()
_MAX_LOGGED_IGNORED = 256


class OpenAIBaseModel(TextOnlyModel):
    """Unknown fields are ignored, as vLLM (and OpenAI's own server) does; each new
    name is logged once at debug."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(_LOGGED_IGNORED) < _MAX_LOGGED_IGNORED:
            fresh = [k for k in data if isinstance(k, str) and k not in cls.model_fields and k not in _LOGGED_IGNORED]
            if fresh:
                _LOGGED_IGNORED.update(fresh[: _MAX_LOGGED_IGNORED - len(_LOGGED_IGNORED)])
                logger.debug("%s: ignoring unknown request fields %s", cls.__name__,
                             [printable(k)[:64] for k in fresh[:16]])
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    #: vLLM: usage on every chunk too (prompt tokens and the choice's tokens so far)
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: the schema (under ``schema``) is enforced;
    ``name``, ``description`` and ``strict`` are accepted (the output always follows
    the schema, as if ``strict``)."""

    name: str = Field(max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


# -- requests ---------------------------------------------------------------------------


class SamplingFields(OpenAIBaseModel):
    """Fields both generation endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    thinking_token_budget: int | None = None  # -1: unlimited (vLLM)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    #: per-request arguments for custom logits processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    length_penalty: float = 1.0  # beam search only: accepted and without effect, as vLLM
    priority: int = 0
    # vLLM's response options
    request_id: str | None = Field(default=None, max_length=512)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # structured outputs: at most one of these constrains the output (see ``output_constraint``)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams fields
    guided_json: str | dict[str, Any] | None = None  # vLLM's legacy fields (removed in vLLM 0.12)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: llguidance is the backend
    # known, not supported yet (see ``unsupported``)
    use_beam_search: bool = False
    logprob_token_ids: list[int] | None = None
    repetition_detection: dict[str, Any] | None = None
    watermarking: bool | None = None

    #: the ``add_special_tokens`` default of this endpoint (vLLM: True for completions)
    ADD_SPECIAL_TOKENS: ClassVar[bool] = True
    #: the output's constraint, found by ``sampling_params`` (errors about it name it)
    _constraint: Constraint | None = PrivateAttr(default=None)

    @property
    def constraint(self) -> Constraint | None:
        return self._constraint

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def usage_options(self) -> tuple[bool, bool]:
        """(usage chunk at the end, usage on every chunk) for a stream, as vLLM."""
        o = self.stream_options
        if not self.streaming or o is None or not o.include_usage:
            return False, False
        return True, bool(o.continuous_usage_stats)

    def unsupported(self) -> Iterator[RequestError]:
        """Fields that would change the result but are not implemented (yet)."""
        if self.use_beam_search:
            yield not_supported("use_beam_search", "beam search is not supported")
        if self.logprob_token_ids:
            yield not_supported("logprob_token_ids")
        if self.repetition_detection is not None:
            yield not_supported("repetition_detection")
        if self.watermarking:
            yield not_supported("watermarking")
        if self.prompt_logprobs is not None and self.streaming and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
            yield RequestError("prompt_logprobs are not available when stream=True (as vLLM)", "prompt_logprobs")

    def check_supported(self) -> None:
        for error in self.unsupported():
            raise error

    def output_constraint(self, options: ApiOptions) -> Constraint | None:
        """The constraint on the output the request asks for, with the field it came
        from (``response_format``, ``structured_outputs`` or a ``guided_*`` field)."""
        constraint, loose = request_constraint(self.response_format, self.structured_outputs, self._legacy_fields(),
                                               options.structured_defaults)
        if loose:
            raise RequestError("structured_outputs sets only options; it must also set one of json, regex, choice, "
                               "grammar, json_object (or go with response_format)", "structured_outputs")
        return constraint

    def _legacy_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                       "guided_grammar", "guided_whitespace_pattern")}

    def sampling_params(self, options: ApiOptions | None = None) -> SamplingParams:
        """The one mapping from a request to ``SamplingParams``; ``options`` are what
        the server's configuration adds (structured-output defaults, tool parser)."""
        self.check_supported()
        options = options or ApiOptions()
        constraint = self.output_constraint(options)
        self._constraint = constraint
        fields: dict[str, Any] = {
            "n": self.num_samples, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "thinking_token_budget": None if self.thinking_token_budget == -1 else self.thinking_token_budget,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words or None,
            "extra_args": self.vllm_xargs or None,
            "output_kind": RequestOutputKind.DELTA if self.streaming else RequestOutputKind.FINAL_ONLY,
        }
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    bias[int(key)] = float(value)
                except ValueError:
                    raise RequestError(f"logit_bias keys must be token ids, got {printable(key)[:64]!r}", "logit_bias") from None
            fields["logit_bias"] = bias
        fields.update(self._endpoint_params())
        if constraint is not None:
            fields["structured_outputs"] = constraint.spec
        fields.update(self._parser_params(options))
        try:
            return SamplingParams(**fields)
        except ValueError as exc:  # SamplingParams names the field first
            named = constraint.explain(exc) if constraint is not None else None
            if named is not None:
                raise RequestError(*named) from None
            name = str(exc).split(" ", 1)[0]
            raise RequestError(str(exc), name if name in fields else None) from None

    def _parser_params(self, options: ApiOptions) -> dict[str, Any]:
        """What the server's output parsers (tools, reasoning) need of the sampling."""
        return {}

    def _endpoint_params(self) -> dict[str, Any]:
        raise NotImplementedError

    def add_special_tokens_or_default(self) -> bool:
        value = getattr(self, "add_special_tokens", None)
        return self.ADD_SPECIAL_TOKENS if value is None else value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None

    def unsupported(self) -> Iterator[RequestError]:
        yield from super().unsupported()
        if self.suffix:
            yield not_supported("suffix", "fill-in-the-middle is not supported")
        if self.best_of is not None and self.best_of != self.num_samples:
            yield not_supported("best_of", "best_of other than n is not supported")
        if self.prompt_embeds is not None:
            yield not_supported("prompt_embeds")

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (lm-eval's loglikelihood call): vLLM runs one
        token and answers with the prompt alone."""
        return bool(self.echo) and self.max_tokens == 0

    def _endpoint_params(self) -> dict[str, Any]:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return {"max_tokens": 1 if self.echo_only else max_tokens, "logprobs": self.logprobs,
                "prompt_logprobs": prompt_logprobs}

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        return list(p)


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


#: Longest tool (function) name accepted (OpenAI's own limit is 64).
MAX_TOOL_NAME_CHARS = 256


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (checked against its meta-schema)
    strict: bool | None = None  # accepted; a named or required call always follows the schema


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class CalledFunction(OpenAIBaseModel):
    name: str = Field(max_length=MAX_TOOL_NAME_CHARS)
    arguments: str | dict[str, Any] | None = None  # a JSON string (OpenAI) or an object


class MessageToolCall(OpenAIBaseModel):
    """A call in an assistant message of the conversation so far."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null only for an assistant message
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers
    #: an assistant turn's reasoning fed back (vLLM's field; ``reasoning_content``, the
    #: older name, is taken too): templates that keep it (Qwen3, DeepSeek) render it
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _fits_role(self) -> ChatMessage:
        if self.reasoning is None and self.reasoning_content is not None:
            self.reasoning = self.reasoning_content
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (only an assistant message may have null)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        return self

    def text(self) -> str:
        # Text parts joined by newlines, as vLLM renders them for string templates.
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it; tool call arguments as dicts (what
        transformers' templates expect), as vLLM passes them."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:  # an empty list is left out, as vLLM does
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": parse_arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:  # both names, as vLLM hands templates
            message["reasoning"] = message["reasoning_content"] = self.reasoning
        return message

    def extra_chars(self) -> int:
        """Characters this message adds to the prompt beyond its text (its calls, its
        reasoning)."""
        total = len(self.reasoning or "")
        for c in self.tool_calls or ():
            arguments = c.function.arguments
            total += len(c.function.name) + (len(arguments) if isinstance(arguments, str) else
                                             len(json.dumps(arguments)) if arguments else 0)
        return total


class ChatFields(OpenAIBaseModel):
    """What chat generation and chat tokenizing share: the conversation and how it is
    rendered."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    tools: list[ChatTool] | None = None

    ADD_SPECIAL_TOKENS: ClassVar[bool] = False  # the template adds them (vLLM's default)
    #: what the request's tools mean (``ChatCompletionRequest.sampling_params`` decides)
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)

    def chat_unsupported(self) -> Iterator[RequestError]:
        if self.chat_template is not None:
            yield not_supported("chat_template", "a chat template from the request is not accepted; "
                                                 "the server's own is used")
        if self.continue_final_message and self.add_generation_prompt:
            yield RequestError("continue_final_message and add_generation_prompt cannot both be true",
                               "continue_final_message")

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools=`` for the chat template (OpenAI's shape, as transformers expects)."""
        if self._tool_plan is not None:
            return self._tool_plan.template_tools()
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def check_prompt_size(self, max_chars: int | None) -> None:
        """Tools and call arguments that alone cannot fit the prompt are refused
        before the template spends any time on them (messages' text is checked by
        the renderer)."""
        if max_chars is None:
            return
        tools = self.template_tools()
        size = sum(m.extra_chars() for m in self.messages) + (len(json.dumps(tools)) if tools else 0)
        if size > max_chars:
            raise RequestError(f"tools: the tools and tool calls ({size} characters) are too long for a prompt of "
                               f"at most {max_chars} characters", "tools")

    def render_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``AsyncLLM.render_chat`` (besides the template)."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message or None,
                "chat_template_kwargs": self.template_kwargs(), "documents": self.documents,
                "tools": self.template_tools()}

    def template_kwargs(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs

    def response_role(self) -> str:
        """The role of the answer: the assistant's, or with no generation prompt the
        last message's (it is being continued), as vLLM."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role


class ChatCompletionRequest(ChatFields, SamplingFields):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM: the answer starts with the last message when it has the answer's role
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    #: "none", "auto" (the default with tools), "required", or {"type": "function", "function": {"name": ...}}
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    include_reasoning: bool = True  # vLLM's: false drops the reasoning from the answer
    functions: Any = None
    function_call: Any = None

    _reasoning: ReasoningParserSpec | None = PrivateAttr(default=None)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
                             f"got {printable(value)[:64]!r}")
        return value

    @property
    def tool_plan(self) -> ToolPlan:
        """What the tools mean (decided by ``sampling_params``)."""
        return self._tool_plan if self._tool_plan is not None else ToolPlan("none")

    def output_constraint(self, options: ApiOptions) -> Constraint | None:
        """The request's own constraint, or the one a named function or "required"
        needs (both at once: a 400)."""
        constraint, loose = request_constraint(self.response_format, self.structured_outputs, self._legacy_fields(),
                                               options.structured_defaults)
        self._tool_plan = plan = ToolPlan.of(self, options)
        constraint = plan.constraint(constraint, loose, options.structured_defaults)
        if loose and constraint is None:
            raise RequestError("structured_outputs sets only options; it must also set one of json, regex, choice, "
                               "grammar, json_object (or go with response_format or a tool_choice)",
                               "structured_outputs")
        return constraint

    @property
    def reasoning(self) -> ReasoningParserSpec | None:
        """The server's reasoning parser where this request's answer has reasoning to
        split off (decided by ``sampling_params``): not when its chat template keywords
        turn thinking off, nor with ``include_reasoning: false`` and an output
        constraint (which then applies from the first token, as vLLM)."""
        return self._reasoning

    def _parser_params(self, options: ApiOptions) -> dict[str, Any]:
        spec = reasoning_parser(options.reasoning_parser) if options.reasoning_parser is not None else None
        if spec is not None and (not spec.thinks(self.template_kwargs()) or (
                self._constraint is not None and not self.include_reasoning)):
            spec = None
        self._reasoning = spec
        params: dict[str, Any] = {}
        if spec is not None and self._constraint is not None:  # the answer is constrained, not the reasoning
            params["structured_outputs"] = {**self._constraint.spec, "after_reasoning": True}
        plan = self.tool_plan
        if (plan.mode == "auto" and plan.parser is not None and TOOL_PARSERS[plan.parser].KEEPS_SPECIAL_TOKENS) or (
                spec is not None and options.reasoning_special_tokens):
            params["skip_special_tokens"] = False
        return params

    def unsupported(self) -> Iterator[RequestError]:
        yield from super().unsupported()
        yield from self.chat_unsupported()
        if self.functions is not None or self.function_call is not None:
            yield not_supported("functions" if self.functions is not None else "function_call",
                                "the legacy function calling fields are not supported; use tools and tool_choice")
        top = self.top_logprobs
        if top is not None and (top > 0 or top == -1) and not self.logprobs:
            yield RequestError("top_logprobs needs logprobs: true", "top_logprobs")

    def _endpoint_params(self) -> dict[str, Any]:
        top = self.top_logprobs or 0
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = top  # vLLM's rule
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return {"max_tokens": max_tokens, "logprobs": top if self.logprobs else None,
                "prompt_logprobs": prompt_logprobs}

    def template_kwargs(self) -> dict[str, Any] | None:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs or None

    def echo_text(self) -> str:
        """What ``echo`` puts before each answer: the last message's text when its role
        is the answer's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role() else ""


# -- tokenizer endpoints ----------------------------------------------------------------


class TokenizeRequest(ChatFields):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # type: ignore[assignment]
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def add_special_tokens_or_default(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None  # vLLM: True for a prompt, False for messages

    def check_supported(self, options: ApiOptions | None = None) -> None:
        if self.messages is not None:
            for error in self.chat_unsupported():
                raise error
            if self.tools is not None:
                ToolPlan.check_tools(self.tools, options or ApiOptions())
        elif self.tools is not None:
            raise RequestError("tools: only with messages (they are rendered by the chat template)", "tools")


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
