"""What the clients hand back: RequestOutput, CompletionOutput and RequestMetrics
(vLLM's field names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass

from sampler.logprobs import FlatLogprobs


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of a request's ``n`` sequences."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: FlatLogprobs | None
    #: "stop" (EOS, a stop token or string), "length" (max_tokens / max_model_len),
    #: "abort", "error"; None while running.
    finish_reason: str | None = None
    #: the stop string or stop token id that ended it (None for EOS and the rest)
    stop_reason: int | str | None = None
    #: ``LLM.chat`` with a ``reasoning_parser`` (an extension; vLLM's offline API does
    #: not split): ``text`` split into the reasoning and the answer (None where there
    #: is none, as the chat endpoint's ``reasoning`` / ``content``)
    reasoning: str | None = None
    content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: FlatLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    #: set when the request ended with an error (a logits processor raised, ...)
    error: str | None = None
    num_cached_tokens: int = 0


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one (what a stream that fell
    behind sends instead of both): per sample its text, tokens and logprobs joined,
    the rest as of the later one; prompt logprobs from whichever carries them."""
    merged = {c.index: c for c in first.outputs}
    for c in later.outputs:
        before = merged.get(c.index)
        if before is None:
            merged[c.index] = c
            continue
        logprobs = before.logprobs
        if c.logprobs is not None:
            logprobs = FlatLogprobs() if logprobs is None else logprobs[:]
            logprobs.extend(c.logprobs)
        merged[c.index] = CompletionOutput(
            index=c.index, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
            cumulative_logprob=c.cumulative_logprob, logprobs=logprobs,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        )
    return RequestOutput(
        request_id=later.request_id, prompt=later.prompt, prompt_token_ids=later.prompt_token_ids,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs,
        outputs=sorted(merged.values(), key=lambda c: c.index), finished=later.finished,
        metrics=later.metrics, error=later.error, num_cached_tokens=later.num_cached_tokens,
    )
