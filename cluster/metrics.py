"""What the engine counts for monitoring, in one place: plain counters and histogram
observations (no Prometheus here; ``deploy/metrics.py`` exposes them, vLLM's names).

The engine updates ``EngineMetrics`` at a few points: around each merged reply (tokens
generated, prompt tokens of sequences that produced their first token, inter-token
latency per request, speculative drafts and accepted tokens), when the scheduler
preempts, when a failed step puts a worker's requests back in the queue (a fault: the
worker died, hung or raised), and when a request leaves the engine (its sequences' finish
reasons and the latencies in its ``RequestMetrics``). A scrape reads ``snapshot()`` from
another thread. The worker pool counts its own losses and replacements
(``WorkerPool.num_failures``, ``num_restarts``).

Counting follows vLLM, where each of a request's ``n`` samples is an engine request of
its own: tokens, ``request_success`` and the per-request token histograms count samples;
the latency histograms count requests (their timestamps are the request's).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Bucket upper bounds, as vLLM's ``vllm/v1/metrics/buckets.py`` (so dashboards built
#: for vLLM read ours unchanged).
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
#: vLLM's finish reasons, each a ``request_success`` series from the start.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
#: Why a failed step re-queued its worker's requests: the worker died or hung (it is
#: replaced), or it raised and was reset (it serves on). Each a series from the start.
REQUEUE_CAUSES = ("worker_lost", "worker_reset")


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class Histogram:
    """Counts per bucket (``counts[i]``: observations <= ``bounds[i]`` and above the
    bound before; the last entry is above every bound) and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Observations <= each bound, then the total (Prometheus' ``le`` buckets)."""
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.sum)


@dataclass
class SchedulerStats:
    """The engine's load now (read at scrape time)."""

    #: sequences holding a row on some worker
    num_running: int
    #: sequences waiting for a row
    num_waiting: int
    #: share of KV blocks held (1.0: full)
    kv_cache_usage: float


@dataclass
class MetricsSnapshot:
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    request_success: dict[str, int]
    histograms: dict[str, Histogram]
    #: requests re-queued by a failed step, by cause (``REQUEUE_CAUSES``)
    requests_requeued: dict[str, int] = field(default_factory=dict)


class EngineMetrics:
    """Counters the engine thread updates and a scrape reads (under one lock)."""

    def __init__(self, max_model_len: int) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.spec_decode_num_drafts = 0
        self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0
        self.request_success = {reason: 0 for reason in FINISH_REASONS}
        self.requests_requeued = {cause: 0 for cause in REQUEUE_CAUSES}
        tokens = request_tokens_buckets(max_model_len)
        self.histograms = {
            "time_to_first_token_seconds": Histogram(TIME_TO_FIRST_TOKEN_BUCKETS),
            "inter_token_latency_seconds": Histogram(INTER_TOKEN_LATENCY_BUCKETS),
            "e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_inference_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_prompt_tokens": Histogram(tokens),
            "request_generation_tokens": Histogram(tokens),
        }

    # -- update points (the engine thread) -------------------------------------------------

    @staticmethod
    def before_reply(rows: Sequence[Any]) -> list[tuple[int, float | None]]:
        """What ``after_reply`` compares against: each row's output length and its
        request's last token time, taken just before the reply is merged."""
        return [(len(s.output_token_ids), s.request.metrics.last_token_time) for s in rows]

    def after_reply(self, rows: Sequence[Any], before: list[tuple[int, float | None]], reply: Any) -> None:
        """A merged reply: tokens kept, prompts of sequences that produced their first
        token, one inter-token latency per request that got tokens after an earlier
        token, and the reply's speculative drafts."""
        prompt = generated = 0
        latencies: dict[int, float] = {}
        for seq, (had, last_time) in zip(rows, before):
            kept = len(seq.output_token_ids) - had
            if kept <= 0:
                continue
            generated += kept
            if had == 0:
                prompt += len(seq.prompt_token_ids)
            now = seq.request.metrics.last_token_time
            if last_time is not None and now is not None and id(seq.request) not in latencies:
                latencies[id(seq.request)] = now - last_time
        drafts = reply.num_draft_tokens.numpy()
        accepted = reply.num_accepted_tokens.numpy()
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            for value in latencies.values():
                self.histograms["inter_token_latency_seconds"].observe(value)
            if len(drafts) and drafts.any():
                self.spec_decode_num_drafts += int((drafts > 0).sum())
                self.spec_decode_num_draft_tokens += int(drafts.sum())
                self.spec_decode_num_accepted_tokens += int(accepted.sum())

    def record_preemptions(self, count: int) -> None:
        with self._lock:
            self.num_preemptions += count

    def record_requeued(self, count: int, cause: str) -> None:
        """A failed step put ``count`` requests (each with at least one unfinished
        sequence) back in the waiting queue; ``cause`` is one of ``REQUEUE_CAUSES``."""
        with self._lock:
            self.requests_requeued[cause] = self.requests_requeued.get(cause, 0) + count

    def record_finished(self, request: Any) -> None:
        """A request left the engine (finished, aborted or failed): each sample's finish
        reason and length, and the request's latencies from its ``RequestMetrics``."""
        m = request.metrics
        end = m.finished_time if m.finished_time is not None else time.time()
        h = self.histograms
        with self._lock:
            for seq in request.sequences:
                reason = seq.finish_reason or "abort"
                self.request_success[reason] = self.request_success.get(reason, 0) + 1
                h["request_prompt_tokens"].observe(len(seq.prompt_token_ids))
                h["request_generation_tokens"].observe(len(seq.output_token_ids))
            h["e2e_request_latency_seconds"].observe(end - m.arrival_time)
            if m.first_scheduled_time is not None:
                h["request_queue_time_seconds"].observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                h["time_to_first_token_seconds"].observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    h["request_prefill_time_seconds"].observe(m.first_token_time - m.first_scheduled_time)
                    h["request_inference_time_seconds"].observe(m.last_token_time - m.first_scheduled_time)
                h["request_decode_time_seconds"].observe(m.last_token_time - m.first_token_time)

    # -- reading (any thread) ---------------------------------------------------------------

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            return MetricsSnapshot(
                prompt_tokens=self.prompt_tokens,
                generation_tokens=self.generation_tokens,
                num_preemptions=self.num_preemptions,
                spec_decode_num_drafts=self.spec_decode_num_drafts,
                spec_decode_num_draft_tokens=self.spec_decode_num_draft_tokens,
                spec_decode_num_accepted_tokens=self.spec_decode_num_accepted_tokens,
                request_success=dict(self.request_success),
                histograms={name: h.copy() for name, h in self.histograms.items()},
                requests_requeued=dict(self.requests_requeued),
            )
