"""WorkerPool: the engine's worker actors, from placement to replacement.

A worker goes through three states: *placing* (the actor exists; Ray has not started
its process yet), *loading* (its process runs ``load``) and *live* (the engine gives it
steps). The pool

- asks Ray for each worker's resources (one GPU each when the cluster has GPUs; else a
  token CPU reservation, so a second engine or a replacement always has room) and says
  within ``placement_report_s`` when a worker cannot be placed, with what it asked for
  and what the cluster has;
- sizes each worker's torch threads from the node it landed on: the node's cores split
  among this engine's workers there (``worker_num_threads`` overrides);
- keeps ``num_workers`` workers: a worker that dies (or fails to load, or is never
  placed) is replaced in a loop with exponential backoff, for as long as the engine
  runs;
- bounds every wait on Ray with a timeout.

The engine owns what a live worker runs (its scheduler, the step in flight); the pool
owns the actor's life.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from cluster.config import EngineConfig
from worker.transport.actor import create_worker, decode_info
from worker.runner.model_loader import ModelLoadError
from worker.transport.protocol import WorkerInfo
from worker.transport.step_channel import StepChannel

logger = logging.getLogger("raydecode")


@dataclass
class SentStep:
    """A step handed to a worker: its reply's ObjectRef (None on the step channel)
    and when it was sent."""

    ref: Any
    step: Any  # the ScheduledStep
    sent_at: float  # perf_counter time it was handed to Ray
    sent_monotonic: float  # monotonic time, for the step timeout


@dataclass
class WorkerSlot:
    """One worker actor and the driver's view of it."""

    index: int
    actor: Any
    resources: dict[str, Any]
    ready_ref: Any  # resolves (node id, cores) once Ray has started the actor
    created_at: float = field(default_factory=time.monotonic)
    load_ref: Any = None  # while the model loads
    node_id: str | None = None
    node_cpus: int = 1
    node_memory: int = 0
    pid: int | None = None  # the actor's process, once placed
    num_threads: int | None = None
    placement_reported: bool = False
    info: WorkerInfo | None = None
    #: the worker's step channel (None: steps go as Ray calls)
    channel: StepChannel | None = None
    # The engine's, once live:
    scheduler: Any = None
    #: steps sent and not yet merged, oldest first (two under async scheduling: the
    #: worker runs one while the next waits in its actor queue)
    pending: list[SentStep] = field(default_factory=list)
    probe_ref: Any = None  # a liveness call on an idle worker
    probed_at: float = 0.0

    @property
    def live(self) -> bool:
        return self.scheduler is not None

    @property
    def inflight(self) -> SentStep | None:
        """The oldest step in flight (None: the worker is idle)."""
        return self.pending[0] if self.pending else None

    @property
    def step(self) -> Any:
        """The oldest ScheduledStep in flight."""
        return self.pending[0].step if self.pending else None

    @property
    def placed(self) -> bool:
        return self.node_id is not None


class WorkerPool:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._worker_config = config.worker_config()
        self._ids = itertools.count()
        self.slots: list[WorkerSlot] = []
        self.num_failures = 0  # workers lost (died, hung, failed to load) since start
        self._start_failures = 0  # consecutive failed starts: the backoff exponent
        self._next_start = 0.0  # monotonic time before which no replacement starts
        self.last_error: str | None = None
        self._resources = self._resources_per_worker()

    # -- views ----------------------------------------------------------------------

    @property
    def live(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.live]

    @property
    def starting(self) -> list[WorkerSlot]:
        return [s for s in self.slots if not s.live]

    def problems(self) -> list[str]:
        """Workers that cannot be placed, as a sentence each."""
        now = time.monotonic()
        return [
            self._placement_message(s, now) for s in self.slots
            if not s.placed and now - s.created_at > self.config.placement_report_s
        ]

    # -- starting -------------------------------------------------------------------

    def _resources_per_worker(self) -> dict[str, Any]:
        c = self.config
        gpus = c.worker_num_gpus
        if gpus is None:
            gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        cpus = c.worker_num_cpus if c.worker_num_cpus is not None else 1
        return {"num_gpus": gpus, "num_cpus": cpus, "resources": dict(c.worker_resources)}

    def _spawn(self) -> WorkerSlot:
        actor = create_worker(**self._resources, compute_thread=self.config.step_channel)
        slot = WorkerSlot(next(self._ids), actor, self._resources, actor.ready.remote())
        self.slots.append(slot)
        return slot

    def start(self) -> list[WorkerSlot]:
        """Starts ``num_workers`` workers and waits until every one has loaded its
        model; raises ``ModelLoadError`` or ``RuntimeError`` (placement, timeout)
        otherwise, having stopped them all."""
        c = self.config
        for _ in range(c.num_workers):
            self._spawn()
        deadline = time.monotonic() + c.worker_start_timeout_s
        loaded: list[WorkerSlot] = []
        try:
            # Every worker is placed before any loads: each then knows how many of this
            # engine's workers share its node (threads, KV memory).
            while True:
                ready, pending = ray.wait([s.ready_ref for s in self.slots], num_returns=len(self.slots), timeout=1.0)
                now = time.monotonic()
                if not pending:
                    break
                if now > deadline:
                    raise RuntimeError(self._placement_message(next(s for s in self.slots if s.ready_ref in pending), now))
                for slot in self.slots:
                    if slot.ready_ref in pending and not slot.placement_reported and now - slot.created_at > c.placement_report_s:
                        slot.placement_reported = True
                        logger.warning(self._placement_message(slot, now))
            for slot in self.slots:  # where every one landed, then the loads
                self._note_placement(slot, self._where(slot))
            for slot in self.slots:
                self._load(slot)
            while len(loaded) < c.num_workers:
                now = time.monotonic()
                if now > deadline:
                    unplaced = [s for s in self.slots if not s.placed]
                    if unplaced:
                        raise RuntimeError(self._placement_message(unplaced[0], now))
                    raise RuntimeError(f"workers did not load their model within worker_start_timeout_s={c.worker_start_timeout_s} s")
                for slot in self.slots:
                    if slot in loaded:
                        continue
                    self._advance(slot, raise_errors=True)
                    if slot.info is not None:
                        loaded.append(slot)
                for slot in self.slots:
                    if not slot.placed and not slot.placement_reported and now - slot.created_at > c.placement_report_s:
                        slot.placement_reported = True
                        logger.warning(self._placement_message(slot, now))
                pending = [s.ready_ref if not s.placed else s.load_ref for s in self.slots if s not in loaded]
                if pending:
                    ray.wait(pending, num_returns=1, timeout=min(1.0, max(0.01, deadline - now)))
        except BaseException:
            self.shutdown()
            raise
        return loaded

    def poll(self) -> list[WorkerSlot]:
        """Moves placing and loading workers on; returns the ones that have just
        loaded (the engine makes them live). Replaces failed starts with backoff and
        starts replacements while the pool is short of ``num_workers``."""
        now = time.monotonic()
        loaded = []
        for slot in self.starting:
            if slot.info is not None:
                continue  # loaded, waiting to be made live
            try:
                self._advance(slot, raise_errors=False)
            except _StartFailed as exc:
                self._drop(slot, f"worker {slot.index} failed to start: {exc}", start_failed=True)
                continue
            if slot.info is not None:
                loaded.append(slot)
            elif not slot.placed and now - slot.created_at > self.config.placement_report_s and not slot.placement_reported:
                slot.placement_reported = True
                logger.warning(self._placement_message(slot, now))
            elif now - slot.created_at > self.config.worker_start_timeout_s:
                why = "could not be placed" if not slot.placed else "did not load its model"
                self._drop(slot, f"worker {slot.index} {why} within worker_start_timeout_s="
                           f"{self.config.worker_start_timeout_s} s", start_failed=True)
        if len(self.slots) < self.config.num_workers and now >= self._next_start:
            slot = self._spawn()
            logger.warning("starting worker %d to replace a lost one", slot.index)
        return loaded

    def _advance(self, slot: WorkerSlot, raise_errors: bool) -> None:
        """One non-blocking look at a starting worker: placed? loaded?"""
        if not slot.placed:
            ready, _ = ray.wait([slot.ready_ref], timeout=0)
            if not ready:
                return
            self._note_placement(slot, self._where(slot))
            self._load(slot)
        if slot.load_ref is None:
            return
        ready, _ = ray.wait([slot.load_ref], timeout=0)
        if not ready:
            return
        try:
            info = decode_info(ray.get(slot.load_ref, timeout=self.config.ray_call_timeout_s))
        except RayTaskError as exc:
            if raise_errors:
                raise ModelLoadError(f"a worker could not load the model: {exc.cause}") from None
            raise _StartFailed(f"could not load the model: {exc.cause}") from None
        except (RayError, GetTimeoutError) as exc:
            if raise_errors:
                raise RuntimeError(f"worker {slot.index} died while loading the model ({type(exc).__name__})") from None
            raise _StartFailed(f"died while loading the model ({type(exc).__name__})") from None
        slot.load_ref = None
        if self.config.step_channel:
            self.open_channel(slot)
        slot.info = info

    def open_channel(self, slot: WorkerSlot) -> None:
        """Connects ``slot``'s step channel (a new one: whatever the old one still held
        is dropped); on failure its steps go as Ray calls."""
        close_channel(slot)
        try:
            address = ray.get(slot.actor.open_channel.remote(), timeout=self.config.ray_call_timeout_s)
            slot.channel = StepChannel(address, send_timeout_s=self.config.step_timeout_s)
        except Exception as exc:  # e.g. a port the engine's node cannot reach
            logger.warning("worker %d: no step channel (%r); its steps go as Ray calls", slot.index, exc)

    def _where(self, slot: WorkerSlot) -> dict[str, Any]:
        try:
            return ray.get(slot.ready_ref, timeout=self.config.ray_call_timeout_s)
        except (RayError, GetTimeoutError) as exc:
            raise _StartFailed(f"worker {slot.index} died before it started ({type(exc).__name__})") from None

    @staticmethod
    def _note_placement(slot: WorkerSlot, where: dict[str, Any]) -> None:
        slot.node_id, slot.pid = where["node_id"], where.get("pid")
        slot.node_cpus, slot.node_memory = max(1, int(where["cpus"])), int(where.get("memory") or 0)

    def _load(self, slot: WorkerSlot) -> None:
        """Sends a placed worker its configuration (threads and KV memory sized for its
        node) and starts the model load."""
        slot.num_threads = self._threads_for(slot)
        config = msgspec.structs.replace(
            self._worker_config, worker_num_threads=slot.num_threads, kv_cache_memory_bytes=self._kv_bytes_for(slot)
        )
        slot.load_ref = slot.actor.load.remote(msgspec.msgpack.encode(config))
        self._rebalance_threads(slot.node_id, exclude=slot)

    def activated(self, slot: WorkerSlot) -> None:
        """The engine made ``slot`` live: starts count as succeeding again."""
        self._start_failures = 0

    # -- sizes ----------------------------------------------------------------------

    def _kv_bytes_for(self, slot: WorkerSlot) -> int | None:
        """A worker's KV budget: the configured bytes; on a GPU None (the worker sizes
        it from gpu_memory_utilization); on CPU its share of ``cpu_kv_cache_fraction``
        of its node's RAM, split among this engine's workers there (so two workers on
        one host do not each take a quarter of it)."""
        c = self.config
        if c.kv_cache_memory_bytes is not None:
            return c.kv_cache_memory_bytes
        if self._resources["num_gpus"] or not slot.node_memory:
            return None
        sharing = sum(1 for s in self.slots if s.node_id == slot.node_id)
        return max(1, int(slot.node_memory * c.cpu_kv_cache_fraction / max(1, sharing)))

    def _threads_for(self, slot: WorkerSlot) -> int:
        c = self.config
        if c.worker_num_threads is not None:
            return c.worker_num_threads
        if c.worker_num_cpus is not None and c.worker_num_cpus >= 1:
            return int(c.worker_num_cpus)
        sharing = sum(1 for s in self.slots if s.node_id == slot.node_id)
        return max(1, slot.node_cpus // max(1, sharing))

    def _rebalance_threads(self, node_id: str | None, exclude: WorkerSlot | None = None) -> None:
        """The workers on ``node_id`` split its cores again (one arrived or left)."""
        for other in self.slots:
            if other is exclude or other.node_id != node_id or other.node_id is None:
                continue
            threads = self._threads_for(other)
            if threads != other.num_threads:
                other.num_threads = threads
                # Ordered before the actor's next step; nothing waits on it.
                other.actor.set_num_threads.remote(threads)

    # -- losing ---------------------------------------------------------------------

    def lost(self, slot: WorkerSlot, reason: str) -> None:
        """A live worker died, hung or could not be reset: it is stopped and a
        replacement starts at once."""
        self._drop(slot, reason, start_failed=False)

    def _drop(self, slot: WorkerSlot, reason: str, start_failed: bool) -> None:
        self.num_failures += 1
        self.last_error = reason
        logger.warning("%s", reason)
        close_channel(slot)
        _kill(slot.actor)
        if slot in self.slots:
            self.slots.remove(slot)
        self._rebalance_threads(slot.node_id)
        if start_failed:
            self._start_failures += 1
            delay = min(self.config.worker_restart_backoff_max_s, 2.0 ** (self._start_failures - 1))
            self._next_start = time.monotonic() + delay
        else:
            self._next_start = 0.0

    def shutdown(self) -> None:
        for slot in self.slots:
            close_channel(slot)
            _kill(slot.actor)
        self.slots = []

    # -- reporting ------------------------------------------------------------------

    def _placement_message(self, slot: WorkerSlot, now: float) -> str:
        asked = {"CPU": slot.resources["num_cpus"], "GPU": slot.resources["num_gpus"], **slot.resources["resources"]}
        asked = {k: v for k, v in asked.items() if v}
        try:
            available, total = ray.available_resources(), ray.cluster_resources()
        except Exception:  # the cluster itself is gone
            available, total = {}, {}
        keys = sorted(set(asked) | {"CPU", "GPU"})
        return (
            f"worker {slot.index} has not been placed for {now - slot.created_at:.0f} s: it asks for "
            f"{asked}; the cluster has {_pick(available, keys)} available of {_pick(total, keys)} "
            "(free some, or lower worker_num_cpus / worker_num_gpus / worker_resources)"
        )


class _StartFailed(RuntimeError):
    """A worker failed to come up (a replacement is retried with backoff)."""


def _pick(resources: dict[str, float], keys: list[str]) -> dict[str, float]:
    return {k: resources.get(k, 0) for k in keys}


def close_channel(slot: WorkerSlot) -> None:
    if slot.channel is not None:
        slot.channel.close()
        slot.channel = None


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone, or Ray itself is
        pass
