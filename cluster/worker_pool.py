"""WorkerPool: the engine's worker actors, from placement to replacement.

A worker goes through three states: *placing* (the actor exists; Ray has not started
its process yet), *loading* (its process runs ``load``) and *live* (the engine gives it
steps). The pool

- asks Ray for each worker's resources (one GPU each when the cluster has GPUs; else a
  token CPU reservation, so a second engine or a replacement always has room) and says
  within ``placement_report_s`` when a worker cannot be placed, with what it asked for
  and what the cluster has (the arithmetic of both is ``cluster/placement.py``);
- sizes each worker's torch threads from the node it landed on: the node's cores split
  among this engine's workers there (``worker_num_threads`` overrides);
- keeps ``num_workers`` workers: a worker that dies (or fails to load, or is never
  placed) is replaced in a loop with exponential backoff, for as long as the engine
  runs;
- bounds every wait on Ray with a timeout.

A worker can be a *group* of ranks (``tensor_parallel_size x pipeline_parallel_size``
Ray actors holding one replica of the model between them, ``worker/runner/
parallel_layout.py``). Everything above holds for the group as a whole: its ranks are
gang-scheduled in one Ray placement group (``placement_group_strategy``: PACK keeps a
group on one node where it fits), they load together (meeting at rank 0's rendezvous
address), the engine steps the group's leader only (it forwards each step to the other
ranks), and a rank that dies takes the group with it: the whole group is replaced.

The engine owns what a live worker runs (its scheduler, the step in flight); the pool
owns the actors' lives.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from cluster.config import EngineConfig
from cluster.placement import RankResources, placement_message, rank_placement, rank_resources, resources_bundle
from cluster.placement import serve_bundles as serve_bundles  # imported from here by deploy/serve.py
from cluster.scheduler import ScheduledStep, WorkerScheduler
from worker import GroupRank, ModelLoadError, WorkerInfo, leader_rank
from worker.transport import StepChannel, create_worker, decode_info

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger("raydecode")


@dataclass
class SentStep:
    """A step handed to a worker: its reply's ObjectRef (None on the step channel)
    and when it was sent."""

    ref: ray.ObjectRef | None
    step: ScheduledStep
    sent_at: float  # perf_counter time it was handed to Ray
    sent_monotonic: float  # monotonic time, for the step timeout


@dataclass
class Rank:
    """One actor of a worker (a single worker is a group of one rank)."""

    actor: ActorHandle
    ready_ref: ray.ObjectRef  # resolves (node id, cores) once Ray has started the actor
    node_id: str | None = None
    node_cpus: int = 1
    node_memory: int = 0
    pid: int | None = None  # the actor's process, once placed
    num_threads: int | None = None
    load_ref: ray.ObjectRef | None = None  # while the model loads
    info: WorkerInfo | None = None  # once loaded

    @property
    def placed(self) -> bool:
        return self.node_id is not None


@dataclass
class WorkerSlot:
    """One worker (a model replica: one actor, or a model-parallel group of them) and
    the driver's view of it."""

    index: int
    ranks: list[Rank]
    resources: RankResources  # what each rank asks for
    leader: int = 0  # the rank the engine steps (it samples and replies)
    lane: int = 0  # which of the engine's num_workers places this worker fills
    placement_group: PlacementGroup | None = None  # the group's, when the pool made one
    created_at: float = field(default_factory=time.monotonic)
    placement_reported: bool = False
    info: WorkerInfo | None = None
    #: the worker's step channel (None: steps go as Ray calls); a group's leader's
    channel: StepChannel | None = None
    #: a group's other ranks' channels: each step goes to every rank, only the leader
    #: replies
    follower_channels: list[StepChannel] = field(default_factory=list)
    # The engine's, once live:
    scheduler: WorkerScheduler | None = None
    #: steps sent and not yet merged, oldest first (two under async scheduling: the
    #: worker runs one while the next waits in its actor queue)
    pending: list[SentStep] = field(default_factory=list)
    probe_refs: list[ray.ObjectRef] = field(default_factory=list)  # liveness calls on every rank
    probed_at: float = 0.0

    @property
    def actor(self) -> ActorHandle:
        """The actor the engine steps (the group's leader)."""
        return self.ranks[self.leader].actor

    @property
    def pid(self) -> int | None:
        return self.ranks[self.leader].pid

    @property
    def node_id(self) -> str | None:
        return self.ranks[self.leader].node_id

    @property
    def num_threads(self) -> int | None:
        return self.ranks[self.leader].num_threads

    @property
    def live(self) -> bool:
        return self.scheduler is not None

    @property
    def inflight(self) -> SentStep | None:
        """The oldest step in flight (None: the worker is idle)."""
        return self.pending[0] if self.pending else None

    @property
    def step(self) -> ScheduledStep | None:
        """The oldest ScheduledStep in flight."""
        return self.pending[0].step if self.pending else None

    @property
    def placed(self) -> bool:
        return all(r.placed for r in self.ranks)

    def waiting_refs(self) -> list[ray.ObjectRef]:
        """What a starting worker waits on: its ranks' placement, then their loads."""
        return [r.ready_ref if not r.placed else r.load_ref for r in self.ranks
                if not r.placed or r.load_ref is not None]


class WorkerPool:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._worker_config = config.worker_config()
        self._ids = itertools.count()
        self.slots: list[WorkerSlot] = []
        self.num_failures = 0  # workers lost (died, hung, failed to load) since start
        self.num_restarts = 0  # replacement workers started (after a loss or a failed start)
        self._start_failures = 0  # consecutive failed starts: the backoff exponent
        self._next_start = 0.0  # monotonic time before which no replacement starts
        self.last_error: str | None = None
        self.group_size = config.group_size
        self._resources = self._resources_per_rank()

    # -- views ----------------------------------------------------------------------

    @property
    def live(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.live]

    @property
    def starting(self) -> list[WorkerSlot]:
        return [s for s in self.slots if not s.live]

    def _ranks(self) -> list[Rank]:
        return [r for s in self.slots for r in s.ranks]

    def problems(self) -> list[str]:
        """Workers that cannot be placed, as a sentence each."""
        now = time.monotonic()
        return [
            self._placement_message(s, now) for s in self.slots
            if not s.placed and now - s.created_at > self.config.placement_report_s
        ]

    # -- starting -------------------------------------------------------------------

    def _resources_per_rank(self) -> RankResources:
        return rank_resources(self.config, ray.cluster_resources().get("GPU", 0))

    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle."""
        return resources_bundle(self._resources)

    def _spawn(self) -> WorkerSlot:
        lanes = {s.lane for s in self.slots}
        lane = next(i for i in itertools.count() if i not in lanes)
        n = self.group_size
        options, pg = rank_placement(self.config, self.bundle(), lane, n)
        ranks = []
        for i in range(n):
            # A group's ranks take their steps on step channels: they need the compute thread.
            actor = create_worker(**self._resources, compute_thread=self.config.step_channel or n > 1, **options[i])
            ranks.append(Rank(actor, actor.ready.remote()))
        slot = WorkerSlot(next(self._ids), ranks, self._resources, leader=leader_rank(
            self.config.tensor_parallel_size, self.config.pipeline_parallel_size), lane=lane, placement_group=pg)
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
            # engine's ranks share its node (threads, KV memory).
            while True:
                refs = [r.ready_ref for r in self._ranks()]
                ready, pending = ray.wait(refs, num_returns=len(refs), timeout=1.0)
                now = time.monotonic()
                if not pending:
                    break
                stuck = [s for s in self.slots if any(r.ready_ref in pending for r in s.ranks)]
                if now > deadline:
                    raise RuntimeError(self._placement_message(stuck[0], now))
                for slot in stuck:
                    if not slot.placement_reported and now - slot.created_at > c.placement_report_s:
                        slot.placement_reported = True
                        logger.warning(self._placement_message(slot, now))
            for slot in self.slots:  # where every rank landed, then the loads
                for rank in slot.ranks:
                    self._note_placement(rank, self._where(slot, rank))
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
                pending = [ref for s in self.slots if s not in loaded for ref in s.waiting_refs()]
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
            self.num_restarts += 1
            logger.warning("starting worker %d to replace a lost one", slot.index)
        return loaded

    def _advance(self, slot: WorkerSlot, raise_errors: bool) -> None:
        """One non-blocking look at a starting worker: placed (every rank)? loaded
        (every rank)?"""
        if not slot.placed:
            unplaced = [r for r in slot.ranks if not r.placed]
            ready, _ = ray.wait([r.ready_ref for r in unplaced], num_returns=len(unplaced), timeout=0)
            try:
                for rank in unplaced:
                    if rank.ready_ref in ready:
                        self._note_placement(rank, self._where(slot, rank))
            except _StartFailed as exc:
                if raise_errors:
                    raise RuntimeError(str(exc)) from None
                raise
            if not slot.placed:
                return
            self._load(slot)
        loading = [r for r in slot.ranks if r.load_ref is not None]
        if not loading:
            return
        ready, _ = ray.wait([r.load_ref for r in loading], num_returns=len(loading), timeout=0)
        for rank in loading:
            if rank.load_ref not in ready:
                continue
            try:
                rank.info = decode_info(ray.get(rank.load_ref, timeout=self.config.ray_call_timeout_s))
            except RayTaskError as exc:
                if raise_errors:
                    raise ModelLoadError(f"a worker could not load the model: {exc.cause}") from None
                raise _StartFailed(f"could not load the model: {exc.cause}") from None
            except (RayError, GetTimeoutError) as exc:
                if raise_errors:
                    raise RuntimeError(f"worker {slot.index} died while loading the model ({type(exc).__name__})") from None
                raise _StartFailed(f"died while loading the model ({type(exc).__name__})") from None
            rank.load_ref = None
        if any(r.info is None for r in slot.ranks):
            return
        info = slot.ranks[slot.leader].info
        if len(slot.ranks) > 1:
            # The driver keeps one block table per group: the smallest pool bounds it.
            info = msgspec.structs.replace(info, num_kv_blocks=min(r.info.num_kv_blocks for r in slot.ranks))
            try:
                self._open_group_channels(slot)
            except Exception as exc:
                if raise_errors:
                    raise RuntimeError(f"worker {slot.index}: its ranks' step channels could not be opened ({exc!r})") from None
                raise _StartFailed(f"its ranks' step channels could not be opened ({exc!r})") from None
        elif self.config.step_channel:
            self.open_channel(slot)
        slot.info = info

    def _open_group_channels(self, slot: WorkerSlot) -> None:
        """A group's steps go straight to every rank (so a later pipeline stage is not
        waited on before an earlier one starts the next step); only the leader replies."""
        close_channel(slot)
        timeout = self.config.ray_call_timeout_s
        refs = [r.actor.open_channel.remote(i == slot.leader) for i, r in enumerate(slot.ranks)]
        addresses = ray.get(refs, timeout=timeout)
        channels = [StepChannel(a, send_timeout_s=self.config.step_timeout_s) for a in addresses]
        slot.channel = channels[slot.leader]
        slot.follower_channels = [c for i, c in enumerate(channels) if i != slot.leader]

    def open_channel(self, slot: WorkerSlot) -> None:
        """Connects ``slot``'s step channel (a new one: whatever the old one still held
        is dropped); on failure its steps go as Ray calls."""
        close_channel(slot)
        try:
            address = ray.get(slot.actor.open_channel.remote(), timeout=self.config.ray_call_timeout_s)
            slot.channel = StepChannel(address, send_timeout_s=self.config.step_timeout_s)
        except Exception as exc:  # e.g. a port the engine's node cannot reach
            logger.warning("worker %d: no step channel (%r); its steps go as Ray calls", slot.index, exc)

    def _where(self, slot: WorkerSlot, rank: Rank) -> dict[str, Any]:
        try:
            return ray.get(rank.ready_ref, timeout=self.config.ray_call_timeout_s)
        except (RayError, GetTimeoutError) as exc:
            raise _StartFailed(f"worker {slot.index} died before it started ({type(exc).__name__})") from None

    @staticmethod
    def _note_placement(rank: Rank, where: dict[str, Any]) -> None:
        rank.node_id, rank.pid = where["node_id"], where.get("pid")
        rank.node_cpus, rank.node_memory = max(1, int(where["cpus"])), int(where.get("memory") or 0)

    def _load(self, slot: WorkerSlot) -> None:
        """Sends a placed worker's ranks their configuration (threads and KV memory
        sized for their node; for a group, each rank's place in it) and starts the
        model loads."""
        ranks = slot.ranks
        group = [None] * len(ranks)
        if len(ranks) > 1:
            group = self._group_ranks(slot)
        for rank, where in zip(ranks, group):
            rank.num_threads = self._threads_for(rank)
            config = msgspec.structs.replace(
                self._worker_config, worker_num_threads=rank.num_threads, kv_cache_memory_bytes=self._kv_bytes_for(rank)
            )
            rank.load_ref = rank.actor.load.remote(msgspec.msgpack.encode(config),
                                                   None if where is None else msgspec.msgpack.encode(where))
        for node in {r.node_id for r in ranks}:
            self._rebalance_threads(node, exclude=ranks)

    def _group_ranks(self, slot: WorkerSlot) -> list[GroupRank]:
        """Each rank's ``GroupRank``: the rendezvous at rank 0, and a shared-memory
        segment for each stage whose tensor ranks share a node (CPU workers)."""
        c = self.config
        init = ray.get(slot.ranks[0].actor.rendezvous_address.remote(len(slot.ranks), c.distributed_timeout_s),
                       timeout=c.ray_call_timeout_s)
        tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
        tag = uuid.uuid4().hex[:12]
        shm: dict[int, str | None] = {}
        for stage in range(pp):
            nodes = {slot.ranks[stage * tp + t].node_id for t in range(tp)}
            cpu = not self._resources["num_gpus"]
            shm[stage] = f"/dev/shm/raydecode-tp-{tag}-{stage}" if tp > 1 and cpu and len(nodes) == 1 else None
        return [GroupRank(rank=i, world_size=tp * pp, init_method=init, shm_path=shm[i // tp],
                          timeout_s=c.distributed_timeout_s) for i in range(len(slot.ranks))]

    def activated(self, slot: WorkerSlot) -> None:
        """The engine made ``slot`` live: starts count as succeeding again."""
        self._start_failures = 0

    # -- sizes ----------------------------------------------------------------------

    def _sharing(self, node_id: str | None) -> int:
        """This engine's ranks on a node."""
        return sum(1 for r in self._ranks() if r.node_id == node_id)

    def _kv_bytes_for(self, rank: Rank) -> int | None:
        """A rank's KV budget: the configured bytes; on a GPU None (the worker sizes
        it from gpu_memory_utilization); on CPU its share of ``cpu_kv_cache_fraction``
        of its node's RAM, split among this engine's ranks there (so two workers on
        one host do not each take a quarter of it)."""
        c = self.config
        if c.kv_cache_memory_bytes is not None:
            return c.kv_cache_memory_bytes
        if self._resources["num_gpus"] or not rank.node_memory:
            return None
        return max(1, int(rank.node_memory * c.cpu_kv_cache_fraction / max(1, self._sharing(rank.node_id))))

    def _threads_for(self, rank: Rank) -> int:
        c = self.config
        if c.worker_num_threads is not None:
            return c.worker_num_threads
        if c.worker_num_cpus is not None and c.worker_num_cpus >= 1:
            return int(c.worker_num_cpus)
        return max(1, rank.node_cpus // max(1, self._sharing(rank.node_id)))

    def _rebalance_threads(self, node_id: str | None, exclude: list[Rank] | None = None) -> None:
        """The ranks on ``node_id`` split its cores again (one arrived or left)."""
        skip = {id(r) for r in exclude or []}
        for other in self._ranks():
            if id(other) in skip or other.node_id != node_id or other.node_id is None:
                continue
            threads = self._threads_for(other)
            if threads != other.num_threads:
                other.num_threads = threads
                # Ordered before the actor's next step; nothing waits on it.
                other.actor.set_num_threads.remote(threads)

    # -- losing ---------------------------------------------------------------------

    def lost(self, slot: WorkerSlot, reason: str) -> None:
        """A live worker died, hung or could not be reset: it is stopped (every rank of
        it) and a replacement starts at once."""
        self._drop(slot, reason, start_failed=False)

    def _drop(self, slot: WorkerSlot, reason: str, start_failed: bool) -> None:
        self.num_failures += 1
        self.last_error = reason
        logger.warning("%s", reason)
        close_channel(slot)
        _stop(slot)
        if slot in self.slots:
            self.slots.remove(slot)
        for node in {r.node_id for r in slot.ranks}:
            self._rebalance_threads(node)
        if start_failed:
            self._start_failures += 1
            delay = min(self.config.worker_restart_backoff_max_s, 2.0 ** (self._start_failures - 1))
            self._next_start = time.monotonic() + delay
        else:
            self._next_start = 0.0

    def shutdown(self) -> None:
        for slot in self.slots:
            close_channel(slot)
            _stop(slot)
        self.slots = []

    # -- reporting ------------------------------------------------------------------

    def _placement_message(self, slot: WorkerSlot, now: float) -> str:
        return placement_message(slot.index, len(slot.ranks), now - slot.created_at, self.bundle(),
                                 self.config.placement_group_strategy)


class _StartFailed(RuntimeError):
    """A worker failed to come up (a replacement is retried with backoff)."""


def close_channel(slot: WorkerSlot) -> None:
    for channel in slot.follower_channels:
        channel.close()
    slot.follower_channels = []
    if slot.channel is not None:
        slot.channel.close()
        slot.channel = None


def _stop(slot: WorkerSlot) -> None:
    """Kills every rank of ``slot`` and frees its placement group."""
    for rank in slot.ranks:
        _kill(rank.actor)
    if slot.placement_group is not None:
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(slot.placement_group)
        except Exception:  # Ray itself is gone
            pass


def _kill(actor: ActorHandle) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone, or Ray itself is
        pass
