"""What the clients hand back: RequestOutput, CompletionOutput and RequestMetrics
(vLLM's field names and meanings, seed 004)."""

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
