"""The OpenAI HTTP API's request bodies, how they map to ``SamplingParams``, and the
response bodies (the ``openai`` package's own models, with vLLM's extra fields).

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

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Literal, Union

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.outputs import CompletionOutput, RequestOutput
from sampler.params import RequestOutputKind, SamplingParams, text_problem

logger = logging.getLogger("raydecode")

#: A logprob of -inf (a token the processors banned) is sent as this, as vLLM and
#: OpenAI do: JSON has no infinity.
MIN_LOGPROB = -9999.0


class RequestError(ValueError):
    """A request the server cannot honour: HTTP 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def not_supported(field: str, why: str = "not supported yet") -> RequestError:
    return RequestError(f"{field}: {why}", field)


# -- hostile text ---------------------------------------------------------------------


def find_bad_text(data: Any, path: str = "") -> str | None:
    """The first string in a decoded JSON body that is not valid Unicode text (a lone
    surrogate, which JSON's ``\\ud800`` escape can carry), as ``"field.path: why"``."""
    if isinstance(data, str):
        problem = text_problem(data)
        return f"{path or 'body'} {problem}" if problem else None
    if isinstance(data, dict):
        for key, value in data.items():
            shown = printable(str(key))
            where = f"{path}.{shown}" if path else shown
            if isinstance(key, str) and text_problem(key):
                return f"{path or 'body'} has a key that {text_problem(key)}"
            found = find_bad_text(value, where)
            if found:
                return found
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found = find_bad_text(value, f"{path}[{i}]")
            if found:
                return found
    return None


def printable(text: str) -> str:
    """``text`` with anything that cannot be encoded (lone surrogates) escaped, so it
    can be echoed back in an error message."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class TextOnlyModel(BaseModel):
    """A request body whose every string, at any depth, must be valid Unicode text:
    checked on the raw body before any field is parsed, so nothing past the HTTP edge
    ever meets a lone surrogate."""

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, data: Any) -> Any:
        found = find_bad_text(data)
        if found:
            raise ValueError(found)
        return data


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
    vllm_xargs: dict[str, Union[str, int, float, list[Union[str, int, float]]]] | None = None
    length_penalty: float = 1.0  # beam search only: accepted and without effect, as vLLM
    priority: int = 0
    # vLLM's response options
    request_id: str | None = Field(default=None, max_length=512)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # known, not supported yet (see ``unsupported``)
    use_beam_search: bool = False
    logprob_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    watermarking: bool | None = None

    #: the ``add_special_tokens`` default of this endpoint (vLLM: True for completions)
    ADD_SPECIAL_TOKENS: ClassVar[bool] = True

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
        if self.response_format is not None and self.response_format.get("type") != "text":
            yield not_supported("response_format", "structured outputs are not supported yet")
        if self.structured_outputs is not None:
            yield not_supported("structured_outputs", "structured outputs are not supported yet")
        if self.repetition_detection is not None:
            yield not_supported("repetition_detection")
        if self.watermarking:
            yield not_supported("watermarking")
        if self.prompt_logprobs is not None and self.streaming and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
            yield RequestError("prompt_logprobs are not available when stream=True (as vLLM)", "prompt_logprobs")

    def check_supported(self) -> None:
        for error in self.unsupported():
            raise error

    def sampling_params(self) -> SamplingParams:
        """The one mapping from a request to ``SamplingParams``."""
        self.check_supported()
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
        try:
            return SamplingParams(**fields)
        except ValueError as exc:  # SamplingParams names the field first
            name = str(exc).split(" ", 1)[0]
            raise RequestError(str(exc), name if name in fields else None) from None

    def _endpoint_params(self) -> dict[str, Any]:
        raise NotImplementedError

    def add_special_tokens_or_default(self) -> bool:
        value = getattr(self, "add_special_tokens", None)
        return self.ADD_SPECIAL_TOKENS if value is None else value


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
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


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None
    tool_calls: Any = None

    def text(self) -> str:
        # Text parts joined by newlines, as vLLM renders them for string templates.
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def as_template_message(self) -> dict[str, str]:
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


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
    tools: list[dict[str, Any]] | None = None

    ADD_SPECIAL_TOKENS: ClassVar[bool] = False  # the template adds them (vLLM's default)

    def chat_unsupported(self) -> Iterator[RequestError]:
        if self.tools is not None:
            yield not_supported("tools", "tool calling is not supported yet")
        if self.chat_template is not None:
            yield not_supported("chat_template", "a chat template from the request is not accepted; "
                                                 "the server's own is used")
        for i, m in enumerate(self.messages):
            if m.tool_calls is not None:
                yield not_supported(f"messages[{i}].tool_calls", "tool calling is not supported yet")
        if self.continue_final_message and self.add_generation_prompt:
            yield RequestError("continue_final_message and add_generation_prompt cannot both be true",
                               "continue_final_message")

    def conversation(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]

    def render_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``AsyncLLM.render_chat`` (besides the template)."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message or None,
                "chat_template_kwargs": self.template_kwargs(), "documents": self.documents}

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
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # vLLM's field; nothing to do without tools

    def unsupported(self) -> Iterator[RequestError]:
        yield from super().unsupported()
        yield from self.chat_unsupported()
        if self.tool_choice not in (None, "none"):
            yield not_supported("tool_choice", "tool calling is not supported yet")
        if self.functions is not None or self.function_call is not None:
            yield not_supported("functions" if self.functions is not None else "function_call",
                                "function calling is not supported yet")
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
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def add_special_tokens_or_default(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None  # vLLM: True for a prompt, False for messages

    def check_supported(self) -> None:
        if self.messages is not None:
            for error in self.chat_unsupported():
                raise error
        elif self.tools is not None:
            raise not_supported("tools", "tool calling is not supported yet")


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# -- responses --------------------------------------------------------------------------


def new_id(prefix: str, request_id: str | None = None) -> str:
    return f"{prefix}-{request_id if request_id is not None else uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> CompletionUsage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _finite(value: float) -> float:
    return max(value, MIN_LOGPROB)


def prompt_logprobs_json(positions: Sequence[dict[int, Any]] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt's token first."""
    if positions is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for position in positions:
        if not position:
            out.append(None)
            continue
        out.append({str(tok): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for tok, lp in position.items()})
    return out


class TokenText:
    """How a token shows in logprobs: its decoded text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``)."""

    def __init__(self, decode: Callable[[int], str], as_ids: bool = False) -> None:
        self.decode, self.as_ids = decode, as_ids

    def __call__(self, token: int, decoded: str | None) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        return decoded if decoded is not None else self.decode(token)


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[dict[int, Any] | None],
    top: int,
    text: TokenText,
    offset: int = 0,
) -> CompletionLogprobs:
    """The completions endpoint's shape: parallel lists plus a dict of the token and the
    top ``top`` per position (None where a position has no logprobs: the first prompt
    token under ``echo``). ``text_offset`` counts from ``offset``."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tok, position in zip(token_ids, positions):
        entry = position.get(tok) if position else None
        shown = text(tok, entry.decoded_token if entry else None)
        tokens.append(shown)
        values.append(_finite(entry.logprob) if entry else None)
        if position:
            tops.append({text(t, lp.decoded_token): _finite(lp.logprob)
                         for i, (t, lp) in enumerate(position.items()) if top == -1 or top >= i})
        else:
            tops.append(None)
        offsets.append(offset)
        offset += len(shown)
    return CompletionLogprobs.model_construct(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


class CompletionChoices:
    """Builds completion choices, whole or streamed, with ``echo`` (the prompt's text,
    tokens and, with logprobs, its logprobs first) and text offsets that keep counting
    across a stream's chunks."""

    def __init__(self, body: CompletionRequest, prompt_texts: list[str] | None, text: TokenText) -> None:
        self.body, self.prompt_texts, self.text = body, prompt_texts, text
        self.n = body.num_samples
        self.echoed: set[int] = set()
        self.sent_prompt_ids: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.tokens: dict[int, int] = {}  # choice index -> tokens generated so far
        self.prompt_tokens: dict[int, int] = {}  # prompt index -> its length
        self.prompt_logprobs: dict[int, Any] = {}  # prompt index -> its prompt logprobs

    def choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        body, index = self.body, prompt_index * self.n + c.index
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(prompt_index, out.prompt_logprobs)
        prompt_logprobs = self.prompt_logprobs.get(prompt_index)
        text, token_ids, positions = c.text, list(c.token_ids), c.logprobs
        if body.echo and index not in self.echoed:
            self.echoed.add(index)
            prompt_ids = list(out.prompt_token_ids)
            prompt_text = self.prompt_texts[prompt_index] if self.prompt_texts else ""
            if body.echo_only:
                text, token_ids, positions = prompt_text, prompt_ids, prompt_logprobs
            else:
                text, token_ids = prompt_text + c.text, prompt_ids + token_ids
                if body.logprobs is not None:
                    positions = [*(prompt_logprobs or []), *(c.logprobs or [])]
        elif body.echo_only:
            text, token_ids, positions = "", [], [] if positions is not None else None
        self.tokens[index] = self.tokens.get(index, 0) + len(c.token_ids)
        logprobs = None
        if body.logprobs is not None and positions is not None:
            logprobs = completion_logprobs(token_ids, positions, body.logprobs, self.text, self.offsets.get(index, 0))
            if logprobs.tokens:
                self.offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        fields: dict[str, Any] = {
            "index": index, "text": text, "finish_reason": c.finish_reason, "logprobs": logprobs,
            "stop_reason": c.stop_reason,
        }
        if not body.streaming:
            fields["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs)
        if body.return_token_ids:  # the prompt's ids once per choice (a stream's first chunk)
            fields["token_ids"] = list(c.token_ids)
            if index not in self.sent_prompt_ids:
                self.sent_prompt_ids.add(index)
                fields["prompt_token_ids"] = list(out.prompt_token_ids)
        return CompletionChoice.model_construct(**fields)

    def usage_of(self, prompt_index: int, index: int) -> CompletionUsage:
        prompt, done = self.prompt_tokens.get(prompt_index, 0), self.tokens.get(index, 0)
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def total_usage(self) -> CompletionUsage:
        prompt, done = sum(self.prompt_tokens.values()), sum(self.tokens.values())
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def completion_response(rid: str, model: str, outputs: list[RequestOutput], builder: CompletionChoices) -> Completion:
    choices = [builder.choice(i, out, c) for i, out in enumerate(outputs) for c in out.outputs]
    return Completion.model_construct(
        id=rid, object="text_completion", created=int(time.time()), model=model,
        choices=choices, usage=usage(outputs),
    )


def completion_chunks(rid: str, model: str, created: int, prompt_index: int, out: RequestOutput,
                      builder: CompletionChoices, continuous_usage: bool) -> list[Completion]:
    """One chunk per choice in ``out`` (vLLM's stream shape)."""
    chunks = []
    for c in out.outputs:
        choice = builder.choice(prompt_index, out, c)
        chunk = Completion.model_construct(id=rid, object="text_completion", created=created, model=model,
                                           choices=[choice])
        if continuous_usage:
            chunk.usage = builder.usage_of(prompt_index, choice.index)
        chunks.append(chunk)
    return chunks


def chat_logprobs(c: CompletionOutput, top: int, text: TokenText) -> ChoiceLogprobs | None:
    if c.logprobs is None:
        return None
    content = []
    for tok, position in zip(c.token_ids, c.logprobs):
        entry = position[tok]
        ranked = sorted(position.items(), key=lambda kv: -kv[1].logprob)
        if top != -1:
            ranked = ranked[:top]
        shown = text(tok, entry.decoded_token)
        content.append(ChatCompletionTokenLogprob(
            token=shown, logprob=_finite(entry.logprob), bytes=list(shown.encode()),
            top_logprobs=[
                TopLogprob(token=text(t, lp.decoded_token), logprob=_finite(lp.logprob),
                           bytes=list(text(t, lp.decoded_token).encode()))
                for t, lp in ranked
            ],
        ))
    return ChoiceLogprobs(content=content)


def chat_response(rid: str, model: str, out: RequestOutput, body: ChatCompletionRequest, text: TokenText) -> ChatCompletion:
    top, role, echo = body.top_logprobs or 0, body.response_role(), body.echo_text()
    choices = []
    for c in out.outputs:
        fields: dict[str, Any] = {
            "index": c.index, "message": ChatCompletionMessage.model_construct(role=role, content=echo + c.text),
            "finish_reason": c.finish_reason, "logprobs": chat_logprobs(c, top, text), "stop_reason": c.stop_reason,
        }
        if body.return_token_ids:
            fields["token_ids"] = list(c.token_ids)
        choices.append(ChatChoice.model_construct(**fields))
    response = ChatCompletion.model_construct(
        id=rid, object="chat.completion", created=int(time.time()), model=model,
        choices=choices, usage=usage([out]), prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
    )
    if body.return_token_ids:
        response.prompt_token_ids = list(out.prompt_token_ids)
    return response


class ChatChunks:
    """A chat stream as vLLM sends it: first a chunk per choice with the role (and
    empty content), then the echoed text if any, then one chunk per choice's delta."""

    def __init__(self, rid: str, model: str, body: ChatCompletionRequest, text: TokenText) -> None:
        self.rid, self.model, self.body, self.text = rid, model, body, text
        self.created = int(time.time())
        self.started = False
        self.prompt_tokens = 0
        self.tokens: dict[int, int] = {}
        _, self.continuous = body.usage_options()

    def _chunk(self, choice: ChunkChoice, index: int, **extra: Any) -> ChatCompletionChunk:
        chunk = ChatCompletionChunk.model_construct(
            id=self.rid, object="chat.completion.chunk", created=self.created, model=self.model,
            choices=[choice], **extra,
        )
        if self.continuous:
            done = self.tokens.get(index, 0)
            chunk.usage = CompletionUsage(prompt_tokens=self.prompt_tokens, completion_tokens=done,
                                          total_tokens=self.prompt_tokens + done)
        return chunk

    def chunks(self, out: RequestOutput) -> list[ChatCompletionChunk]:
        body, chunks = self.body, []
        self.prompt_tokens = len(out.prompt_token_ids)
        if not self.started:
            self.started = True
            extra = {"prompt_token_ids": list(out.prompt_token_ids)} if body.return_token_ids else {}
            for i in range(body.num_samples):
                delta = ChoiceDelta.model_construct(role=body.response_role(), content="")
                chunks.append(self._chunk(ChunkChoice.model_construct(index=i, delta=delta, logprobs=None,
                                                                      finish_reason=None), i, **extra))
            echo = body.echo_text()
            if echo:
                for i in range(body.num_samples):
                    delta = ChoiceDelta.model_construct(content=echo)
                    chunks.append(self._chunk(ChunkChoice.model_construct(index=i, delta=delta, logprobs=None,
                                                                          finish_reason=None), i))
        for c in out.outputs:
            self.tokens[c.index] = self.tokens.get(c.index, 0) + len(c.token_ids)
            fields: dict[str, Any] = {
                "index": c.index, "delta": ChoiceDelta.model_construct(content=c.text),
                "finish_reason": c.finish_reason, "logprobs": chat_logprobs(c, body.top_logprobs or 0, self.text),
                "stop_reason": c.stop_reason,
            }
            if body.return_token_ids:
                fields["token_ids"] = list(c.token_ids)
            chunks.append(self._chunk(ChunkChoice.model_construct(**fields), c.index))
        return chunks

    def total_usage(self) -> CompletionUsage:
        done = sum(self.tokens.values())
        return CompletionUsage(prompt_tokens=self.prompt_tokens, completion_tokens=done,
                               total_tokens=self.prompt_tokens + done)


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object; the text is made encodable whatever input it quotes."""
    return {"error": {"message": printable(message), "type": kind,
                      "param": None if param is None else printable(param), "code": code}}
