"""The chat endpoint's responses (``/v1/chat/completions``), whole or streamed:
``chat_response`` for a whole answer, ``ChatChunks`` for a stream (the state it keeps
across chunks: whether the role was sent, each choice's reasoning split and tool call
parser, tokens so far), the reasoning apart from the content under a reasoning parser
(``cluster/reasoning_parsers.py``; tools are parsed from the content), tool calls in OpenAI's message and delta shapes, and ``chat_logprobs``, this
endpoint's logprobs shape (per token, its ``top_logprobs``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from openai.types import CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_message_function_tool_call import Function as CalledToolFunction
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_usage import CompletionTokensDetails

from cluster.outputs import CompletionOutput, RequestOutput
from deploy.openai.protocol import ChatCompletionRequest
from deploy.openai.responses import TokenText, construct, finite_logprob, prompt_logprobs_json, usage
from deploy.openai.tool_parsers import ToolCall, ToolCallDelta

#: a text's length in the model's tokens
TokenCount = Callable[[str], int]


def chat_logprobs(c: CompletionOutput, top: int, text: TokenText) -> ChoiceLogprobs | None:
    """The chat endpoint's shape: per generated token its logprob and bytes, and the
    ``top`` most likely (-1: all) best first."""
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
            token=shown, logprob=finite_logprob(entry.logprob), bytes=list(shown.encode()),
            top_logprobs=[
                TopLogprob(token=text(t, lp.decoded_token), logprob=finite_logprob(lp.logprob),
                           bytes=list(text(t, lp.decoded_token).encode()))
                for t, lp in ranked
            ],
        ))
    return ChoiceLogprobs(content=content)


def _message_tool_calls(calls: list[ToolCall]) -> list[ChatCompletionMessageFunctionToolCall]:
    return [
        construct(ChatCompletionMessageFunctionToolCall, id=c.id, type="function",
                  function=construct(CalledToolFunction, name=c.name, arguments=c.arguments))
        for c in calls
    ]


def _delta_tool_calls(deltas: list[ToolCallDelta]) -> list[ChoiceDeltaToolCall]:
    """Stream pieces of calls, one entry per call index (the pieces of one index in
    one chunk joined: the first carries id, type and name)."""
    merged: dict[int, ToolCallDelta] = {}
    for d in deltas:
        if d.index in merged:
            merged[d.index].arguments += d.arguments
        else:
            merged[d.index] = ToolCallDelta(d.index, d.arguments, d.id, d.name)
    out = []
    for d in merged.values():
        if d.id is not None:
            function = construct(ChoiceDeltaToolCallFunction, name=d.name, arguments=d.arguments)
            out.append(construct(ChoiceDeltaToolCall, index=d.index, id=d.id, type="function", function=function))
        else:
            function = construct(ChoiceDeltaToolCallFunction, arguments=d.arguments)
            out.append(construct(ChoiceDeltaToolCall, index=d.index, function=function))
    return out


def _usage_with_reasoning(total: CompletionUsage, reasoning: list[str], count_tokens: TokenCount | None) -> CompletionUsage:
    """``total`` with ``completion_tokens_details.reasoning_tokens`` (the reasoning's
    texts counted in tokens), as vLLM reports it when it has a reasoning parser."""
    if count_tokens is not None:
        total.completion_tokens_details = CompletionTokensDetails(
            reasoning_tokens=sum(count_tokens(r) for r in reasoning if r))
    return total


def chat_response(rid: str, model: str, out: RequestOutput, body: ChatCompletionRequest, text: TokenText,
                  count_tokens: TokenCount | None = None) -> ChatCompletion:
    """The whole answer. ``count_tokens``: the tokenizer's count of a text, for the
    reasoning tokens in ``usage`` (None: not reported)."""
    top, role, echo = body.top_logprobs or 0, body.response_role(), body.echo_text()
    plan, spec = body.tool_plan, body.reasoning
    choices, reasonings = [], []
    for c in out.outputs:
        finish_reason, content, calls, extra = c.finish_reason, c.text, [], {}
        if spec is not None:
            reasoning, answer = spec.split(c.text, body.template_kwargs())
            content = answer or ""
            reasonings.append(reasoning or "")
            extra["reasoning"] = reasoning if body.include_reasoning else None  # vLLM's field
        if plan.parses:
            content, calls = plan.parser_for_choice().parse(content)
            finish_reason = plan.finish_reason(c.finish_reason, bool(calls))
        if calls:
            content = echo + content if content else (echo or plan.empty_content())
            message = construct(ChatCompletionMessage, role=role, content=content,
                                tool_calls=_message_tool_calls(calls), **extra)
        else:
            content = echo + content
            message = construct(ChatCompletionMessage, role=role,
                                content=content if spec is None else content or None, **extra)
        fields: dict[str, Any] = {
            "index": c.index, "message": message,
            "finish_reason": finish_reason, "logprobs": chat_logprobs(c, top, text), "stop_reason": c.stop_reason,
        }
        if body.return_token_ids:
            fields["token_ids"] = list(c.token_ids)
        choices.append(construct(ChatChoice, **fields))
    response = construct(
        ChatCompletion, id=rid, object="chat.completion", created=int(time.time()), model=model,
        choices=choices, usage=_usage_with_reasoning(usage([out]), reasonings, count_tokens),
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
    )
    if body.return_token_ids:
        response.prompt_token_ids = list(out.prompt_token_ids)
    return response


class ChatChunks:
    """A chat stream as vLLM sends it: first a chunk per choice with the role (and
    empty content), then the echoed text if any, then one chunk per choice's delta."""

    def __init__(self, rid: str, model: str, body: ChatCompletionRequest, text: TokenText,
                 count_tokens: TokenCount | None = None) -> None:
        self.rid, self.model, self.body, self.text = rid, model, body, text
        self.count_tokens = count_tokens
        self.reasoning: dict[int, list[str]] = {}  # each choice's reasoning so far
        plan = body.tool_plan
        self.plan = plan if plan.parses else None
        self.parsers = [plan.parser_for_choice() for _ in range(body.num_samples)] if self.plan else []
        spec = body.reasoning
        self.splits = [spec.new_split(body.template_kwargs()) for _ in range(body.num_samples)] if spec else []
        self.created = int(time.time())
        self.started = False
        self.prompt_tokens = 0
        self.tokens: dict[int, int] = {}
        _, self.continuous = body.usage_options()

    def _chunk(self, choice: ChunkChoice, index: int, **extra: Any) -> ChatCompletionChunk:
        chunk = construct(
            ChatCompletionChunk, id=self.rid, object="chat.completion.chunk", created=self.created, model=self.model,
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
                delta = construct(ChoiceDelta, role=body.response_role(), content="")
                chunks.append(self._chunk(construct(ChunkChoice, index=i, delta=delta, logprobs=None,
                                                                      finish_reason=None), i, **extra))
            echo = body.echo_text()
            if echo:
                for i in range(body.num_samples):
                    delta = construct(ChoiceDelta, content=echo)
                    chunks.append(self._chunk(construct(ChunkChoice, index=i, delta=delta, logprobs=None,
                                                                          finish_reason=None), i))
        for c in out.outputs:
            self.tokens[c.index] = self.tokens.get(c.index, 0) + len(c.token_ids)
            logprobs = chat_logprobs(c, body.top_logprobs or 0, self.text)
            delta, finish_reason = construct(ChoiceDelta, content=c.text), c.finish_reason
            if self.plan is not None or self.splits:
                lead, delta, finish_reason = self._parsed_delta(c)
                if lead is not None:
                    chunks.append(self._chunk(construct(ChunkChoice, index=c.index, delta=lead, logprobs=None,
                                                        finish_reason=None), c.index))
                if delta is None:
                    if c.finish_reason is None and logprobs is None and not body.return_token_ids:
                        continue  # nothing to send yet (text held back by the parser)
                    delta = construct(ChoiceDelta)
            fields: dict[str, Any] = {
                "index": c.index, "delta": delta,
                "finish_reason": finish_reason, "logprobs": logprobs,
                "stop_reason": c.stop_reason,
            }
            if body.return_token_ids:
                fields["token_ids"] = list(c.token_ids)
            chunks.append(self._chunk(construct(ChunkChoice, **fields), c.index))
        return chunks

    def _parsed_delta(self, c: CompletionOutput) -> tuple[ChoiceDelta | None, ChoiceDelta | None, str | None]:
        """A choice's delta through its reasoning split and its tool call parser (None:
        nothing to send), and its finish reason; first, when there is content too, the
        last pieces of a call announced in an earlier chunk, in a delta of their own
        (they precede that content in the text: a client that turns content into a new
        item, as the Responses API does, has them before the call's item closes)."""
        lead = None
        finish_reason, reasoning, answer = c.finish_reason, "", c.text
        if self.splits:
            split = self.splits[c.index]
            reasoning, answer = split.feed(c.text)
            if finish_reason is not None:
                more_reasoning, more_answer = split.finish()
                reasoning, answer = reasoning + more_reasoning, answer + more_answer
        fields: dict[str, Any] = {}
        if reasoning:
            self.reasoning.setdefault(c.index, []).append(reasoning)
        if reasoning and self.body.include_reasoning:
            fields["reasoning"] = reasoning
        content = answer
        if self.plan is not None:
            parser = self.parsers[c.index]
            content, deltas = parser.feed(answer)
            if finish_reason is not None:
                more, last = parser.finish()
                content, deltas = content + more, deltas + last
                finish_reason = self.plan.finish_reason(finish_reason, bool(parser.calls))
            new = {d.index for d in deltas if d.id is not None}
            earlier = [d for d in deltas if d.index not in new]
            if content and earlier:
                lead, deltas = construct(ChoiceDelta, tool_calls=_delta_tool_calls(earlier)), [
                    d for d in deltas if d.index in new]
            if deltas:
                fields["tool_calls"] = _delta_tool_calls(deltas)
        if content:
            fields["content"] = content
        return lead, (construct(ChoiceDelta, **fields) if fields else None), finish_reason

    def total_usage(self) -> CompletionUsage:
        done = sum(self.tokens.values())
        total = CompletionUsage(prompt_tokens=self.prompt_tokens, completion_tokens=done,
                                total_tokens=self.prompt_tokens + done)
        return _usage_with_reasoning(total, ["".join(parts) for parts in self.reasoning.values()], self.count_tokens)
