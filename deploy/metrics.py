"""``GET /metrics``: the engine's counters (``cluster/metrics.py``) as Prometheus text,
with vLLM's metric names, types, help texts, labels (``model_name``, ``engine``, and
``finished_reason``) and histogram buckets (``vllm/v1/metrics/loggers.py``), so
dashboards built for vLLM work unchanged. Read at scrape time by one collector in a
registry of its own (nothing global, nothing kept between scrapes).

Each Serve replica has its own engine and answers for it alone (``engine="0"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from cluster.metrics import FINISH_REASONS, Histogram

LABELS = ["model_name", "engine"]

#: (our histogram, vLLM's metric name, its help text)
HISTOGRAMS = [
    ("time_to_first_token_seconds", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("inter_token_latency_seconds", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("request_queue_time_seconds", "vllm:request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request."),
    ("request_inference_time_seconds", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("request_prefill_time_seconds", "vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request."),
    ("request_decode_time_seconds", "vllm:request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request."),
    ("request_prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    ("request_generation_tokens", "vllm:request_generation_tokens", "Number of generation tokens processed."),
]


class EngineCollector:
    """Reads one engine's counters and load at each scrape."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.labels = [model_name, "0"]

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: names come from collect()

    def collect(self) -> Iterator[Metric]:
        engine, labels = self.engine, self.labels
        stats = engine.scheduler_stats()
        snap = engine.metrics.snapshot()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", snap.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", snap.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", snap.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=LABELS + ["finished_reason"])
        for reason in dict.fromkeys([*FINISH_REASONS, *snap.request_success]):
            success.add_metric(labels + [reason], snap.request_success.get(reason, 0))
        yield success
        if engine.config.num_spec_tokens > 0:  # as vLLM: only with speculative decoding on
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", snap.spec_decode_num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                          snap.spec_decode_num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          snap.spec_decode_num_accepted_tokens)
        # Per worker (vLLM's "engine" label is its data-parallel engine): prompt tokens
        # looked up in the prefix cache, and those found (a replaced worker starts at 0).
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", labels=LABELS)
        hits = CounterMetricFamily("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.", labels=LABELS)
        for worker in engine.prefix_cache_stats():
            queries.add_metric([labels[0], str(worker["worker"])], worker["queries"])
            hits.add_metric([labels[0], str(worker["worker"])], worker["hits"])
        yield queries
        yield hits
        # The engine's workers (each a model replica: one actor, or a model-parallel
        # group of ranks): live ones, the configured count (fewer live: degraded while a
        # lost one, or a group that lost a rank, is replaced), and those lost so far.
        health = engine.health()
        yield gauge("raydecode:workers_live", "Workers (model replicas) serving now.", health["live_workers"])
        yield gauge("raydecode:workers_configured", "Workers (model replicas) the engine keeps.", engine.config.num_workers)
        yield gauge("raydecode:ranks_per_worker", "Ray actors per worker (tensor x pipeline parallel size).",
                    health["ranks_per_worker"])
        yield counter("raydecode:worker_failures", "Workers lost (died, hung, failed to start) since the engine started.",
                      health["worker_failures"])
        for key, name, doc in HISTOGRAMS:
            yield histogram(name, doc, labels, snap.histograms[key])


def histogram(name: str, doc: str, labels: list[str], h: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=LABELS)
    cumulative = h.cumulative()
    buckets = [(floatToGoString(b), c) for b, c in zip(h.bounds, cumulative)] + [("+Inf", cumulative[-1])]
    family.add_metric(labels, buckets, sum_value=h.sum)
    return family


def metrics_registry(engine: Any, model_name: str) -> CollectorRegistry:
    """A registry of its own holding the engine's collector (``generate_latest`` it)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry
