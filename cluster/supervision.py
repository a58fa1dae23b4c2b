"""WorkerSupervisor: the engine's watch over its live workers.

Faults, one mechanism for all of them: whatever keeps a step from coming back (the worker
died, its node or its reply object was lost, the step hung past ``step_timeout_s``, the
worker raised, the step could not be sent or its reply not merged) is a *failed step*.
Every sequence the worker held goes back to the waiting queue with its tokens so far, and
each request that was in the failed step is charged one failure. A charged sequence
runs alone on a worker until it gets past the point where it failed, so a request that
crashes workers is found out exactly and, after ``max_request_failures``, finishes with
an error by itself while the others carry on. A worker that died or hung is replaced
(``WorkerPool``: a loop with backoff); one that raised is reset. While no worker is
alive, requests wait at most ``no_worker_timeout_s`` and then fail with the reason.

The supervisor holds what this needs beside the step loop: the liveness probes of idle
workers, the failed step's consequences, the wait while no worker is alive, and the
engine's health ("workers alive and steps progressing"). The engine tells it of each
step that completed (``progressed``) and of each that failed (``step_failed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayError

from cluster.config import EngineConfig
from cluster.metrics import EngineMetrics
from cluster.request import Request
from cluster.scheduler import ScheduledStep, WaitingQueue
from cluster.worker_pool import WorkerPool, WorkerSlot

logger = logging.getLogger("raydecode")

#: Seconds between liveness probes of a worker with no step in flight (or with one on
#: its step channel).
IDLE_PROBE_S = 5.0


class WorkerSupervisor:
    """Watches the workers of ``pool`` for an engine whose requests are ``requests``
    (by id) and whose queue is ``waiting``; ``fail`` finishes a request with an error
    (the engine's bookkeeping: its rows freed, its final output sent)."""

    def __init__(self, config: EngineConfig, pool: WorkerPool, waiting: WaitingQueue, requests: dict[str, Request],
                 metrics: EngineMetrics, fail: Callable[[Request, str], None]) -> None:
        self.config = config
        self.pool = pool
        self.waiting = waiting
        self.requests = requests
        self.metrics = metrics
        self._fail = fail
        #: monotonic time of the last completed (or failed) step, or of being idle
        self.last_progress = time.monotonic()
        self._no_worker_since: float | None = None

    def progressed(self) -> None:
        """A step completed, or there is nothing to do: the engine is not stalled."""
        self.last_progress = time.monotonic()

    def probe(self) -> None:
        """Probes idle workers so that one that died while idle is replaced before
        anyone needs it."""
        now = time.monotonic()
        for slot in [w for w in self.pool.slots if w.live]:
            # A step on the channel does not tell of a node that vanished without
            # closing its sockets (a Ray call would), so busy channel workers are probed too.
            probe = slot.inflight is None or slot.channel is not None
            if not slot.probe_refs:
                if probe and now - slot.probed_at > IDLE_PROBE_S:
                    # Every rank of a group: one that died takes the group down.
                    slot.probe_refs, slot.probed_at = [r.actor.health.remote() for r in slot.ranks], now
                continue
            refs = slot.probe_refs
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs) and now - slot.probed_at < self.config.ray_call_timeout_s:
                continue
            slot.probe_refs = []
            try:
                ray.get(refs, timeout=0 if len(ready) < len(refs) else self.config.ray_call_timeout_s)
            except RayError as exc:
                if probe:  # else the step in flight reports it
                    state = "idle" if slot.inflight is None else "running a step"
                    self.step_failed(slot, slot.step, f"worker {slot.index} was lost while {state} "
                                     f"({type(exc).__name__})", lost=True)

    def step_failed(self, slot: WorkerSlot, step: ScheduledStep | None, reason: str, lost: bool) -> None:
        """A step that will not come back (see the module docstring). ``lost``: the
        worker died or hung and is replaced; otherwise it is reset and serves on. Steps
        sent after it (async scheduling) are dropped with it, uncharged."""
        dropped = [sent.step for sent in slot.pending]
        if step is not None and all(s is not step for s in dropped):
            dropped.append(step)  # already taken off ``pending`` (or never on it)
        for s in dropped:
            s.settle()
        slot.pending = []
        in_step = {id(s) for s in step.rows} if step is not None else set()
        charged: set[int] = set()
        requeued: set[int] = set()
        for seq in slot.scheduler.release_all():
            if seq.finished:
                continue
            request = seq.request
            if id(seq) in in_step:
                seq.suspect_until = len(seq.output_token_ids)
                if id(request) not in charged:
                    charged.add(id(request))
                    request.num_failures += 1
            if request.num_failures >= self.config.max_request_failures:
                if not request.finished:
                    self._fail(request, f"the request failed {request.num_failures} times "
                                        f"(max_request_failures): {reason}")
            else:
                self.waiting.push(seq)
                requeued.add(id(request))
        logger.warning("%s; %d requests charged a failure, their sequences re-queued", reason, len(charged))
        self.last_progress = time.monotonic()
        if len(slot.ranks) > 1:
            # A group's ranks may have parted in the middle of their collectives: it is
            # replaced whole rather than reset.
            lost = True
        if not lost:
            # The reset closes the worker's step channel first (a step queued behind the
            # failed one must not run after it), so a new one is opened.
            had_channel = slot.channel is not None
            try:
                ray.get(slot.actor.reset.remote(), timeout=self.config.ray_call_timeout_s)
                if had_channel:
                    self.pool.open_channel(slot)
                self.metrics.record_requeued(len(requeued), "worker_reset")
                return
            except RayError as exc:
                reason = f"{reason}; then its reset failed ({type(exc).__name__})"
        self.metrics.record_requeued(len(requeued), "worker_lost")
        self.pool.lost(slot, reason)

    def wait_for_workers(self, timeout: float) -> None:
        """No live worker: wait (bounded) for a starting one."""
        starting = [ref for w in self.pool.slots if not w.live for ref in w.waiting_refs()]
        if starting:
            ray.wait(starting, num_returns=1, timeout=min(timeout, 0.5))
        else:
            time.sleep(min(timeout, 0.1))

    def expire_without_workers(self) -> None:
        """While no worker is alive, a request waits at most ``no_worker_timeout_s``."""
        if any(w.live for w in self.pool.slots):
            self._no_worker_since = None
            return
        now = time.monotonic()
        if self._no_worker_since is None:
            self._no_worker_since = now
        limit = self.config.no_worker_timeout_s
        for request in list(self.requests.values()):
            if now - max(request.enqueued_at, self._no_worker_since) > limit:
                self._fail(request, f"no live worker for {limit:.0f} s (no_worker_timeout_s); "
                                    f"last worker error: {self.pool.last_error}")

    def health(self) -> dict[str, Any]:
        """``healthy`` is False (with ``problems`` saying why) when no worker has been
        alive for ``no_worker_timeout_s``, or no step completed for longer than a step
        may take while requests wait. ``warnings`` name workers that cannot be placed.
        Safe to call from another thread."""
        c, now = self.config, time.monotonic()
        problems = []
        since = self._no_worker_since
        if since is not None and now - since > c.no_worker_timeout_s:
            problems.append(f"no live worker for {now - since:.0f} s; last worker error: {self.pool.last_error}")
        stalled = now - self.last_progress
        if self.requests and stalled > c.step_timeout_s + c.ray_call_timeout_s:
            problems.append(f"no step completed for {stalled:.0f} s while {len(self.requests)} requests wait")
        workers = list(self.pool.slots)
        return {
            "healthy": not problems,
            "problems": problems,
            "warnings": self.pool.problems(),
            "live_workers": sum(w.live for w in workers),
            "ranks_per_worker": self.pool.group_size,
            # what each live worker's KV pool holds (a group: its smallest rank's pool)
            "kv_tokens_per_worker": [w.scheduler.kv_blocks * c.kv_block_size for w in workers if w.live],
            # a worker short of num_workers (a lost one, or a group that lost a rank, is
            # being replaced): serving, at less than full strength
            "degraded": sum(w.live for w in workers) < c.num_workers,
            "starting_workers": sum(not w.live for w in workers),
            "worker_failures": self.pool.num_failures,
            "worker_restarts": self.pool.num_restarts,
            "running_requests": len(self.requests),
            "waiting_sequences": len(self.waiting),
        }
