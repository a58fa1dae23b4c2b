"""Request: one submitted prompt with its ``n`` sequences, prompt logprobs and metrics,
and the RequestOutput it shows in each output kind (cumulative, delta, final only)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from cluster.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cluster.pooling import PoolingOutput, PoolingParams, PoolingRequestOutput, finish_vector
from cluster.sequence import Sequence
from sampler.logprobs import FlatLogprobs, create_prompt_logprobs
from sampler.params import RequestOutputKind, SamplingParams
from worker import LoRAAdapter
from worker.pooling import PoolerSpec


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample ``index`` of ``n``: a seeded request gives sample i the
    seed ``seed + i`` (distinct, reproducible streams, as vLLM does); only sample 0
    computes prompt logprobs (they are the same for every sample)."""
    if index == 0:
        return params
    changes: dict[str, Any] = {"prompt_logprobs": None}
    if params.seed is not None:
        changes["seed"] = params.seed + index
    return params.clone(**changes)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        max_model_len: int,
        order: int,
        priority: int = 0,
        arrival_time: float | None = None,
        lora: LoRAAdapter | None = None,
        pooling: PoolingParams | None = None,
        pooler: PoolerSpec | None = None,
        token_type_ids: list[int] | None = None,
    ) -> None:
        """``pooling``: a pooling request (of a model whose pooler is ``pooler``): its
        prompt runs once and it finishes with one vector, no tokens (``params`` then
        only carry what every request has); ``token_type_ids``: an encoder prompt's
        token types (a cross-encoder's pair)."""
        self.request_id = request_id
        #: a pooling request's options, the model's pooler, and the worker's raw vector
        self.pooling = pooling
        self.pooler = pooler
        self.pooled: np.ndarray | None = None
        #: the LoRA adapter it runs with (None: the base model)
        self.lora = lora
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        self.error: str | None = None
        self.prompt_logprobs: FlatLogprobs | None = (
            create_prompt_logprobs() if params.prompt_logprobs is not None else None
        )
        #: failed steps this request was in (the engine fails it at max_request_failures)
        self.num_failures = 0
        self.enqueued_at = 0.0  # monotonic time the engine queued it
        self.sequences: list[Sequence] = []
        for i in range(params.n):
            # The engine's order number makes the id unique whatever the caller's id
            # looks like ("a" with n=2 next to a request named "a#1", say).
            seq_id = f"{order}.{i}"
            seq = Sequence(seq_id, i, prompt_token_ids, child_params(params, i), tokenizer, max_model_len)
            seq.request, seq.priority, seq.order, seq.lora = self, priority, order, lora
            if pooling is not None:
                seq.token_type_ids = token_type_ids
                seq.pools_every_position = pooler is not None and pooler.pooling_type != "LAST"
            self.sequences.append(seq)
        self._sent_prompt_logprobs = False
        self._sent_final = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def finish(self, reason: str, error: str | None = None) -> None:
        """Ends every unfinished sequence ("abort", "error")."""
        if error is not None and self.error is None:
            self.error = error
        for seq in self.sequences:
            seq.finish(reason)
        self._mark_finished()

    def _mark_finished(self) -> None:
        if self.finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.time()

    def set_pooled(self, vector: np.ndarray, now: float) -> None:
        """A worker's raw vector: the pooling request is done."""
        self.pooled = np.array(vector, dtype=np.float32)
        for seq in self.sequences:
            seq.finish("stop")
        self.note_tokens(now)

    def note_tokens(self, now: float) -> None:
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self._mark_finished()

    # -- outputs ------------------------------------------------------------------------

    def make_output(self) -> RequestOutput | None:
        """What this request shows now, per its output kind; None when there is nothing
        to show (final-only while running, or a delta with nothing new)."""
        finished = self.finished
        if self._sent_final:
            return None
        if self.pooling is not None:
            return self._pooling_output()
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        plp = self.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            completions = [c for c in (self._delta(s) for s in self.sequences) if c is not None]
            if not completions and not finished:
                return None
            # Sent once, whole: with n > 1 a later sample's first token can come before
            # sample 0 has run the end of the prompt.
            prompt_logprobs = None
            if plp is not None and not self._sent_prompt_logprobs and (finished or len(plp) >= len(self.prompt_token_ids)):
                prompt_logprobs, self._sent_prompt_logprobs = plp[:], True
        else:
            completions = [self._cumulative(s) for s in self.sequences]
            prompt_logprobs = plp[:] if plp is not None else None  # a snapshot: the engine keeps appending
        self._sent_final = finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=self.metrics,
            error=self.error,
            num_cached_tokens=max(s.num_cached_tokens or 0 for s in self.sequences),
        )

    def _pooling_output(self) -> PoolingRequestOutput | None:
        """A pooling request shows one output, once finished: its vector as asked for
        (None when it failed or was aborted, ``error`` saying why)."""
        if not self.finished:
            return None
        self._sent_final = True
        data = None
        if self.pooled is not None and self.error is None:
            data = PoolingOutput(torch.from_numpy(finish_vector(self.pooled, self.pooling, self.pooler)))
        error = None if data is not None else self.error or "aborted"
        return PoolingRequestOutput(
            request_id=self.request_id, outputs=data, prompt_token_ids=self.prompt_token_ids, finished=True,
            error=error, num_cached_tokens=max(s.num_cached_tokens or 0 for s in self.sequences), prompt=self.prompt,
        )

    @staticmethod
    def _cumulative(seq: Sequence) -> CompletionOutput:
        return CompletionOutput(
            index=seq.index,
            text=seq.detokenizer.visible_text(seq.finished),
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs[:] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    @staticmethod
    def _delta(seq: Sequence) -> CompletionOutput | None:
        new_tokens = seq.output_token_ids[seq.sent_tokens :]
        if not new_tokens and not (seq.finished and not seq.sent_finished):
            return None
        logprobs = None
        if seq.logprobs is not None:
            logprobs = seq.logprobs[seq.sent_logprobs :]
            seq.sent_logprobs = len(seq.logprobs)
        seq.sent_tokens = len(seq.output_token_ids)
        seq.sent_finished = seq.finished
        return CompletionOutput(
            index=seq.index,
            text=seq.detokenizer.take_delta(seq.finished),
            token_ids=new_tokens,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
