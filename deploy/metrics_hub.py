"""``/metrics`` for every replica of a Serve application, not only the one the proxy
picked: a small hub actor per application that the replicas push their metric families
to, and that each replica's ``/metrics`` reads the others' from. This module is the hub
alone (light imports: its actor starts in a second); the replica's side is
``deploy.metrics.ReplicaMetrics``.

- ``MetricsHub``: a named Ray actor per application (``num_cpus=0``, detached, in the
  ``raydecode_metrics`` namespace, created by the first replica that asks:
  ``get_if_exists``). It keeps each replica's latest families, counts the replicas live
  per model and the scale events (a replica joining, one leaving), and leaves by itself
  once it has had no replica for ``idle_exit_s``.
- ``ReplicaMetrics`` (``deploy/metrics.py``): what a replica runs. A daemon thread
  pushes the engine's families every ``push_interval_s`` (the first push before the
  replica serves); ``exposition()`` (the ``/metrics`` handler)
  returns this replica's families read now, the other replicas' latest ones, and the
  hub's replica families, merged: one family per name, one ``engine`` label value per
  replica (its Serve replica id). If the hub cannot be reached, a replica answers for
  itself alone (and leaves the replica families out rather than guess them).

A replica leaves the hub's view when it says so (``close()``), when its actor is found
dead (the hub probes a replica silent for ``probe_after_s``), or when it has been silent
for ``ttl_s`` (a hung one). Counters of a replica that left go with it (Prometheus'
``rate`` and ``increase`` handle a series that ends). The hub's own counters start from
zero when it is re-created (after its idle exit, or a crash).

Why not Ray's own metrics export (``ray.util.metrics``): Ray prefixes every name
(``ray_...``), so vLLM's names (and vLLM's dashboards) would not hold, and Prometheus
would have to discover and scrape every node's metrics agent instead of the app's one
``/metrics``; this keeps the app's endpoint the one scrape target, with vLLM's names.
Why not a Serve deployment-scoped actor (``DeploymentActorConfig``, alpha in Ray 2.60),
whose life Serve ties to the deployment: it is declared in the deployment's options,
and it is re-created per code version, so a redeploy would reset the scale events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger("raydecode")

NAMESPACE = "raydecode_metrics"
#: seconds between a replica's pushes (the most a scrape's figures lag the engines)
PUSH_INTERVAL_S = 1.0
#: a replica silent this long has left (hung, or its node went unseen)
TTL_S = 15.0
#: a replica silent this long has its actor probed: a dead one leaves at once
PROBE_AFTER_S = 3.0
#: the hub leaves after this long without any replica
IDLE_EXIT_S = 60.0
#: bound on a ``/metrics`` handler's wait for the hub
VIEW_TIMEOUT_S = 5.0
#: bound on a replica's first push, made before it serves (the first replica of an
#: app starts the hub then)
FIRST_PUSH_TIMEOUT_S = 30.0
#: scale event directions
DIRECTIONS = ("up", "down")


@dataclass
class _Replica:
    model_name: str
    families: list[Metric]
    pushed_at: float
    actor: Any = None  # its Ray actor, when it runs in one (a Serve replica does)
    probe: Any = None  # a liveness call in flight


class MetricsHub:
    """The application's view of its replicas (a Ray actor: ``hub_handle``)."""

    def __init__(self, ttl_s: float = TTL_S, probe_after_s: float = PROBE_AFTER_S,
                 idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.ttl_s, self.probe_after_s, self.idle_exit_s = ttl_s, probe_after_s, idle_exit_s
        self.replicas: dict[str, _Replica] = {}
        self.scale_events: dict[tuple[str, str], int] = {}
        self._empty_since: float | None = time.monotonic()
        self._ticker: asyncio.Task | None = None

    def _count(self, model_name: str, direction: str) -> None:
        key = (model_name, direction)
        self.scale_events[key] = self.scale_events.get(key, 0) + 1

    def _leave(self, replica_id: str, why: str) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is None:
            return
        self._count(replica.model_name, "down")
        logger.info("metrics hub: replica %s left (%s)", replica_id, why)
        if not self.replicas:
            self._empty_since = time.monotonic()

    def _start_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.probe_after_s / 2))
            try:
                await self.tick()
            except Exception:  # the hub must outlive a bad tick
                logger.exception("metrics hub tick failed")
            if self._empty_since is not None and time.monotonic() - self._empty_since > self.idle_exit_s:
                logger.info("metrics hub: no replica for %.0f s, leaving", self.idle_exit_s)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    async def tick(self) -> None:
        """Drops replicas silent past ``ttl_s`` and those whose actor died."""
        now = time.monotonic()
        for replica_id, r in list(self.replicas.items()):
            silent = now - r.pushed_at
            if silent > self.ttl_s:
                self._leave(replica_id, f"silent for {silent:.0f} s")
                continue
            if r.actor is None or silent < self.probe_after_s:
                continue
            if r.probe is None:
                r.probe = r.actor.__ray_ready__.remote()
                continue
            ready, _ = ray.wait([r.probe], timeout=0)
            if not ready:
                continue
            try:
                await r.probe
                r.probe = None  # alive, only slow to push: the TTL decides
            except ray.exceptions.RayActorError:
                self._leave(replica_id, "its actor died")
            except Exception:
                r.probe = None

    # -- what replicas call ---------------------------------------------------------

    async def push(self, replica_id: str, model_name: str, families: list[Metric], actor: Any = None) -> None:
        """A replica's latest families (the first push is the replica joining)."""
        self._start_ticker()
        r = self.replicas.get(replica_id)
        if r is None:
            self._count(model_name, "up")
            self._empty_since = None
            logger.info("metrics hub: replica %s joined", replica_id)
            self.replicas[replica_id] = _Replica(model_name, families, time.monotonic(), actor)
            return
        r.model_name, r.families, r.pushed_at, r.probe = model_name, families, time.monotonic(), None
        if actor is not None:
            r.actor = actor

    async def drop(self, replica_id: str) -> None:
        """The replica is shutting down."""
        self._start_ticker()
        self._leave(replica_id, "it shut down")

    async def view(self, exclude: str | None = None) -> dict[str, Any]:
        """The live replicas' latest families (but ``exclude``'s), the live replicas per
        model, and the scale events per (model, direction)."""
        self._start_ticker()
        await self.tick()
        return {
            "families": {rid: r.families for rid, r in self.replicas.items() if rid != exclude},
            "models": {rid: r.model_name for rid, r in self.replicas.items()},
            "scale_events": dict(self.scale_events),
        }


def hub_name(app_name: str) -> str:
    return f"metrics-hub:{app_name}"


def hub_handle(app_name: str, **hub_kwargs: Any) -> Any:
    """The application's hub, created if it does not exist yet. It lives on the head
    node (Ray's ``node:__internal_head__`` resource), as Serve's controller does: on a
    worker node it would keep that node from ever being idle, and an autoscaler could
    never remove it."""
    return ray.remote(MetricsHub).options(
        name=hub_name(app_name), namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
        max_restarts=0, resources={"node:__internal_head__": 0.001},
    ).remote(**hub_kwargs)


def replica_families(models: dict[str, str], scale_events: dict[tuple[str, str], int]) -> list[Metric]:
    """``raydecode:replicas_live`` and ``raydecode:replica_scale_events`` per model."""
    live = GaugeMetricFamily("raydecode:replicas_live", "Serve replicas (each an engine) of the application serving now.",
                             labels=["model_name"])
    counts: dict[str, int] = {}
    for model in models.values():
        counts[model] = counts.get(model, 0) + 1
    for model, n in sorted(counts.items()):
        live.add_metric([model], n)
    events = CounterMetricFamily(
        "raydecode:replica_scale_events",
        "Serve replicas that joined (direction=up) or left (direction=down) the application, as the metrics hub saw them.",
        labels=["model_name", "direction"])
    for model in sorted({m for m, _ in scale_events} | set(counts)):
        for direction in DIRECTIONS:
            events.add_metric([model, direction], scale_events.get((model, direction), 0))
    return [live, events]
