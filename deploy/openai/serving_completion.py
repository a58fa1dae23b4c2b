"""The completions endpoint's responses (``/v1/completions``), whole or streamed:
``CompletionChoices`` keeps the state a stream needs across its chunks (what was
echoed, text offsets, tokens so far), ``completion_response`` and ``completion_chunks``
wrap its choices, and ``completion_logprobs`` is this endpoint's logprobs shape
(parallel lists, with ``echo`` the prompt's tokens first).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.completion_choice import Logprobs as CompletionLogprobs

from cluster.outputs import CompletionOutput, RequestOutput
from deploy.openai.protocol import CompletionRequest
from deploy.openai.responses import TokenText, construct, finite_logprob, prompt_logprobs_json, usage


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
        values.append(finite_logprob(entry.logprob) if entry else None)
        if position:
            tops.append({text(t, lp.decoded_token): finite_logprob(lp.logprob)
                         for i, (t, lp) in enumerate(position.items()) if top == -1 or top >= i})
        else:
            tops.append(None)
        offsets.append(offset)
        offset += len(shown)
    return construct(CompletionLogprobs, tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


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
        return construct(CompletionChoice, **fields)

    def usage_of(self, prompt_index: int, index: int) -> CompletionUsage:
        prompt, done = self.prompt_tokens.get(prompt_index, 0), self.tokens.get(index, 0)
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    def total_usage(self) -> CompletionUsage:
        prompt, done = sum(self.prompt_tokens.values()), sum(self.tokens.values())
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def completion_response(rid: str, model: str, outputs: list[RequestOutput], builder: CompletionChoices) -> Completion:
    choices = [builder.choice(i, out, c) for i, out in enumerate(outputs) for c in out.outputs]
    return construct(
        Completion, id=rid, object="text_completion", created=int(time.time()), model=model,
        choices=choices, usage=usage(outputs),
    )


def completion_chunks(rid: str, model: str, created: int, prompt_index: int, out: RequestOutput,
                      builder: CompletionChoices, continuous_usage: bool) -> list[Completion]:
    """One chunk per choice in ``out`` (vLLM's stream shape)."""
    chunks = []
    for c in out.outputs:
        choice = builder.choice(prompt_index, out, c)
        chunk = construct(Completion, id=rid, object="text_completion", created=created, model=model,
                                           choices=[choice])
        if continuous_usage:
            chunk.usage = builder.usage_of(prompt_index, choice.index)
        chunks.append(chunk)
    return chunks
