"""``GET /metrics``: the engine's counters (``cluster/metrics.py``) as Prometheus text,
with vLLM's metric names, types, help texts, labels (``model_name``, ``engine``, and
``finished_reason``) and histogram buckets (``vllm/v1/metrics/loggers.py``), so
dashboards built for vLLM work unchanged. Read at scrape time by one collector in a
registry of its own (nothing global, nothing kept between scrapes). vLLM's metrics keep
vLLM's names; ours (workers, faults, replicas) are ``raydecode:``.

The ``engine`` label names the engine: a Serve replica's id (``replica_label()``), "0"
outside Serve. A Serve app of several replicas answers ``/metrics`` for all of them:
each replica's families with its own ``engine`` label, merged (``merge_families``):
``ReplicaMetrics`` pushes this replica's to the app's hub (``deploy/metrics_hub.py``,
which also counts the live replicas and scale events) and reads the others' from it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from cluster.metrics import FINISH_REASONS, REQUEUE_CAUSES, Histogram

logger = logging.getLogger("raydecode")

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


def replica_label() -> str:
    """This engine's ``engine`` label: the Serve replica's id inside a replica, else
    "0" (one engine in the process)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not inside a Serve replica
        return "0"


class EngineCollector:
    """Reads one engine's counters and load at each scrape."""

    def __init__(self, engine: Any, model_name: str, engine_label: str = "0") -> None:
        self.engine = engine
        self.labels = [model_name, engine_label]

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
        if engine.config.enable_lora:  # vLLM's: the adapters in use now, as labels; the value is the time
            running, waiting = engine.lora_adapters()
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=LABELS + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric(labels + [str(engine.config.max_loras), ",".join(running), ",".join(waiting)], time.time())
            yield info
        if engine.config.spec_tokens > 0:  # as vLLM: only with speculative decoding on
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", snap.spec_decode_num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                          snap.spec_decode_num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          snap.spec_decode_num_accepted_tokens)
        # Per worker of this engine (the "worker" label; each worker has a prefix cache
        # of its own): prompt tokens looked up in it, and those found (a replaced worker
        # is a new series from 0).
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.",
                                      labels=LABELS + ["worker"])
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                   labels=LABELS + ["worker"])
        for worker in engine.prefix_cache_stats():
            queries.add_metric(labels + [str(worker["worker"])], worker["queries"])
            hits.add_metric(labels + [str(worker["worker"])], worker["hits"])
        yield queries
        yield hits
        # The engine's workers (each a model replica: one actor, or a model-parallel
        # group of ranks): live ones, starting ones, the configured count (fewer live:
        # degraded while a lost one, or a group that lost a rank, is replaced), those
        # lost so far and the replacements started for them.
        health = engine.health()
        yield gauge("raydecode:workers_live", "Workers (model replicas) serving now.", health["live_workers"])
        yield gauge("raydecode:workers_starting", "Workers placed or loading their model, not serving yet.",
                    health["starting_workers"])
        yield gauge("raydecode:workers_configured", "Workers (model replicas) the engine keeps.", engine.config.num_workers)
        yield gauge("raydecode:ranks_per_worker", "Ray actors per worker (tensor x pipeline parallel size).",
                    health["ranks_per_worker"])
        yield counter("raydecode:worker_failures", "Workers lost (died, hung, failed to start) since the engine started.",
                      health["worker_failures"])
        yield counter("raydecode:worker_restarts", "Replacement workers started after a worker was lost or failed to start.",
                      health["worker_restarts"])
        requeued = CounterMetricFamily(
            "raydecode:requests_requeued",
            "Requests put back in the queue, with their tokens so far, by a failed step (cause: worker_lost, the worker "
            "died or hung; worker_reset, it raised and was reset).", labels=LABELS + ["cause"])
        for cause in dict.fromkeys([*REQUEUE_CAUSES, *snap.requests_requeued]):
            requeued.add_metric(labels + [cause], snap.requests_requeued.get(cause, 0))
        yield requeued
        for key, name, doc in HISTOGRAMS:
            yield histogram(name, doc, labels, snap.histograms[key])


def histogram(name: str, doc: str, labels: list[str], h: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=LABELS)
    cumulative = h.cumulative()
    buckets = [(floatToGoString(b), c) for b, c in zip(h.bounds, cumulative)] + [("+Inf", cumulative[-1])]
    family.add_metric(labels, buckets, sum_value=h.sum)
    return family


def metrics_registry(engine: Any, model_name: str, engine_label: str = "0") -> CollectorRegistry:
    """A registry of its own holding the engine's collector (``generate_latest`` it)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name, engine_label))
    return registry


def merge_families(groups: Iterable[Iterable[Metric]]) -> list[Metric]:
    """Families of several engines as one exposition: a name seen in several groups is
    one family (the first group's type and help) holding every group's samples, each
    group's kept together (their ``engine`` labels tell them apart). A family whose
    type differs from the first one of its name is dropped (a replica of other code
    during a redeploy must not make the whole scrape unparsable)."""
    merged: dict[str, Metric] = {}
    for group in groups:
        for family in group:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            elif into.type != family.type:
                continue
            into.samples.extend(family.samples)
    return list(merged.values())


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def exposition(families: list[Metric]) -> bytes:
    """Prometheus text of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


class ReplicaMetrics:
    """One Serve replica's side of ``/metrics`` across the app (``deploy/metrics_hub.py``):
    a daemon thread pushes this engine's families to the app's hub every
    ``push_interval_s`` (the first push is made before the replica serves, so the
    first scrape already finds the hub); ``exposition()`` is the ``/metrics`` answer:
    this engine's families read now, the other replicas' latest, and the replica
    families, merged. Outside Serve (no ``app_name`` and no replica context) it answers
    for its engine alone and starts no hub. With ``engine`` None (a deployment without
    an engine of its own, such as an ingress in front of engine deployments) it pushes
    nothing and answers with the replicas' families from the hub."""

    def __init__(self, engine: Any | None, model_name: str, app_name: str | None = None, replica_id: str | None = None,
                 push_interval_s: float | None = None, **hub_kwargs: Any) -> None:
        from deploy import metrics_hub

        self._hubs = metrics_hub
        self.app_name = app_name if app_name is not None else _serve_app_name()
        self.replica_id = replica_id if replica_id is not None else replica_label()
        self.model_name = model_name
        self.collector = EngineCollector(engine, model_name, self.replica_id) if engine is not None else None
        self.push_interval_s = push_interval_s if push_interval_s is not None else metrics_hub.PUSH_INTERVAL_S
        self._hub_kwargs = hub_kwargs
        self._hub: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._actor = _current_actor()
        self._thread: threading.Thread | None = None
        if self.app_name is None or self.collector is None:
            return
        try:
            self.push(timeout_s=metrics_hub.FIRST_PUSH_TIMEOUT_S)
        except Exception as exc:  # the thread tries again
            logger.warning("the first metrics push to the hub of app %r failed (%r)", self.app_name, exc)
        self._thread = threading.Thread(target=self._push_forever, name="raydecode-metrics-push", daemon=True)
        self._thread.start()

    def families(self) -> list[Metric]:
        """This engine's families, read now (none without an engine)."""
        return list(self.collector.collect()) if self.collector is not None else []

    def hub(self) -> Any:
        """The app's hub (created if none is running), or None outside Serve."""
        with self._lock:
            if self._hub is None and self.app_name is not None:
                self._hub = self._hubs.hub_handle(self.app_name, **self._hub_kwargs)
            return self._hub

    def _forget_hub(self, hub: Any) -> None:
        with self._lock:
            if self._hub is hub:
                self._hub = None

    def push(self, timeout_s: float | None = None) -> None:
        """One push of this engine's families (raises if the hub does not take it)."""
        hub = self.hub()
        if hub is None or self.collector is None:
            return
        try:
            ray.get(hub.push.remote(self.replica_id, self.model_name, self.families(), self._actor),
                    timeout=timeout_s if timeout_s is not None else max(5.0, 2 * self.push_interval_s))
        except ray.exceptions.RayActorError:
            self._forget_hub(hub)  # gone (its idle exit, a crash): found or made anew next time
            raise

    def _push_forever(self) -> None:
        failures = 0
        while not self._stop.wait(self.push_interval_s):
            try:
                self.push()
                failures = 0
            except Exception as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("metrics push to the hub of app %r failed %d times (%r)", self.app_name, failures, exc)

    async def view(self) -> dict[str, Any] | None:
        """The hub's view without this replica, or None if it does not answer in time."""
        if self.app_name is None:
            return None
        hub = None
        try:
            hub = self._hub if self._hub is not None else await asyncio.to_thread(self.hub)
            exclude = self.replica_id if self.collector is not None else None
            return await asyncio.wait_for(_await(hub.view.remote(exclude)), self._hubs.VIEW_TIMEOUT_S)
        except Exception as exc:
            logger.warning("the metrics hub of app %r did not answer (%r): /metrics covers this replica only",
                           self.app_name, exc)
            if hub is not None and isinstance(exc, ray.exceptions.RayActorError):
                self._forget_hub(hub)
            return None

    async def exposition(self) -> bytes:
        """``/metrics``: every live replica's families and the replica counts."""
        own = self.families()
        view = await self.view()
        if view is None:
            return exposition(own)
        others = [view["families"][rid] for rid in sorted(view["families"])]
        models = dict(view["models"])
        if self.collector is not None:
            models[self.replica_id] = self.model_name
        return exposition(merge_families([own, *others, self._hubs.replica_families(models, view["scale_events"])]))

    def close(self) -> None:
        """Stops pushing and tells the hub this replica leaves (for the replica's
        ``__del__``; without it the hub notices within ``PROBE_AFTER_S`` of the
        replica's actor dying, or ``TTL_S`` of its silence)."""
        self._stop.set()
        hub = self._hub
        if hub is not None:
            try:
                ray.get(hub.drop.remote(self.replica_id), timeout=5.0)
            except Exception:  # the hub or Ray is gone: it finds out by itself
                pass


async def _await(ref: Any) -> Any:
    return await ref


def _serve_app_name() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:  # not inside a Serve replica
        return None


def _current_actor() -> Any:
    try:
        return ray.get_runtime_context().current_actor
    except Exception:  # not inside an actor
        return None
