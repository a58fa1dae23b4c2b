"""The OpenAI HTTP API's request bodies and how they map to ``SamplingParams``; response
bodies are the ``openai`` package's own models.

Request models forbid unknown fields (a typo is a 400, not a silently ignored option) and
accept vLLM's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, thinking_token_budget, stop_token_ids, skip_special_tokens,
include_stop_str_in_output). Logprobs keep each endpoint's own shape: completions take
``logprobs: int`` (top-n per token); chat takes ``logprobs: bool`` plus ``top_logprobs``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(TextOnlyModel):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    thinking_token_budget: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    def _params(self, max_tokens: int | None, logprobs: int | None, kind: RequestOutputKind) -> SamplingParams:
        fields: dict[str, Any] = {
            "n": self.n, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "max_tokens": max_tokens, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "logprobs": logprobs, "thinking_token_budget": self.thinking_token_budget,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output, "output_kind": kind,
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
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            fields["logit_bias"] = bias
        return SamplingParams(**fields)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return self._params(self.max_tokens, self.logprobs, kind)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return self._params(max_tokens, logprobs, kind)

    def conversation(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]


# -- responses ------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> CompletionUsage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_logprobs(c: CompletionOutput, offset: int = 0) -> CompletionLogprobs | None:
    """The completions endpoint's shape: parallel lists plus a top-n dict per token."""
    if c.logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    at = offset
    for tok, position in zip(c.token_ids, c.logprobs):
        entry = position.get(tok)
        text = entry.decoded_token if entry else ""
        tokens.append(text)
        values.append(entry.logprob if entry else None)
        tops.append({lp.decoded_token: lp.logprob for lp in position.values()})  # sampled + top-n, as vLLM
        offsets.append(at)
        at += len(text or "")
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(c: CompletionOutput, top: int) -> ChoiceLogprobs | None:
    if c.logprobs is None:
        return None
    content = []
    for tok, position in zip(c.token_ids, c.logprobs):
        entry = position[tok]
        ranked = sorted(position.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append(ChatCompletionTokenLogprob(
            token=entry.decoded_token or "", logprob=entry.logprob,
            bytes=list((entry.decoded_token or "").encode()),
            top_logprobs=[
                TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob, bytes=list((lp.decoded_token or "").encode()))
                for _, lp in ranked
            ],
        ))
    return ChoiceLogprobs(content=content)


def _completion_choices(prompt_index: int, n: int, out: RequestOutput) -> list[CompletionChoice]:
    """Choice ``prompt_index * n + sample`` for each completion of one prompt (vLLM's order)."""
    return [
        CompletionChoice.model_construct(
            index=prompt_index * n + c.index, text=c.text, finish_reason=c.finish_reason,
            logprobs=completion_logprobs(c), stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]


def completion_response(rid: str, model: str, n: int, outputs: list[RequestOutput]) -> Completion:
    choices = [choice for i, out in enumerate(outputs) for choice in _completion_choices(i, n, out)]
    return Completion.model_construct(
        id=rid, object="text_completion", created=int(time.time()), model=model,
        choices=choices, usage=usage(outputs),
    )


def completion_chunk(rid: str, model: str, prompt_index: int, n: int, out: RequestOutput, created: int) -> Completion:
    return Completion.model_construct(
        id=rid, object="text_completion", created=created, model=model,
        choices=_completion_choices(prompt_index, n, out),
    )


def chat_response(rid: str, model: str, out: RequestOutput, top: int) -> ChatCompletion:
    choices = [
        ChatChoice.model_construct(
            index=c.index, message=ChatCompletionMessage(role="assistant", content=c.text),
            finish_reason=c.finish_reason, logprobs=chat_logprobs(c, top), stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    return ChatCompletion.model_construct(
        id=rid, object="chat.completion", created=int(time.time()), model=model,
        choices=choices, usage=usage([out]),
    )


def chat_chunk(rid: str, model: str, created: int, choices: list[ChunkChoice], usage_: CompletionUsage | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_construct(
        id=rid, object="chat.completion.chunk", created=created, model=model, choices=choices, usage=usage_,
    )


def chat_delta_choice(c: CompletionOutput, top: int, first: bool) -> ChunkChoice:
    delta = ChoiceDelta(role="assistant", content=c.text) if first else ChoiceDelta(content=c.text)
    return ChunkChoice.model_construct(
        index=c.index, delta=delta, finish_reason=c.finish_reason, logprobs=chat_logprobs(c, top),
    )


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object; the text is made encodable whatever input it quotes."""
    return {"error": {"message": printable(message), "type": kind,
                      "param": None if param is None else printable(param), "code": code}}
