"""The Ray worker actor: a ModelRunner behind bytes-in, bytes-out methods.

The driver decides everything about scheduling; the actor loads a model, applies each
step message to its persistent batch, runs it, and answers with one reply. A step
message that does not decode or does not fit the batch raises ``ProtocolError`` (Ray
hands it to the caller; the actor and its batch are untouched). Create actors with
``create_worker`` (GPU when ``num_gpus`` > 0) and keep ``max_task_retries=0``: a retried
step would run twice.

Steps arrive as Ray calls or on the step channel (``worker/transport/step_channel.py``).
Either way every torch call (load, steps, reset, thread counts) runs on one compute
thread (``worker/transport/compute_thread.py``), which also reads and answers the channel.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec
import psutil
import ray
import torch

from worker.config import WorkerConfig
from worker.protocol import Codec, WorkerInfo
from worker.transport.compute_thread import ComputeThread
from worker.transport.niceness import set_niceness
from worker.transport.step_channel import ChannelAddress, StepChannelServer, channel_host

logger = logging.getLogger("raydecode")


class StaleStep(RuntimeError):
    """A step read from a step channel that a reset has closed since."""


class Worker:
    """Plain class (usable without Ray in tests); ``create_worker`` makes it an actor."""

    def __init__(self, compute_thread: bool = True) -> None:
        """``compute_thread``: run torch on a thread of its own that can also serve a
        step channel (else Ray calls run it on the actor's main thread, as a plain
        worker driven only by Ray calls needs no more)."""
        self._codec = Codec()  # built here: msgspec encoders do not pickle
        self._runner = None
        self._steps = 0
        self._started = time.time()
        self._compute = ComputeThread() if compute_thread else None
        self._run = self._compute.run if self._compute is not None else _call
        self._channel: StepChannelServer | None = None
        #: bumped by each reset; a channel serves the generation it was opened in
        self._generation = 0

    def ready(self) -> dict[str, Any]:
        """Answers as soon as the actor runs: where it landed and how many cores that
        process may use (the driver sizes its threads from them before ``load``)."""
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        memory = psutil.virtual_memory().total
        return {"node_id": node_id, "cpus": _usable_cores(), "pid": os.getpid(), "memory": memory}

    def set_num_threads(self, num_threads: int) -> None:
        """Torch's intra-op threads (the driver re-splits a node's cores when workers
        arrive or leave)."""
        self._run(torch.set_num_threads, max(1, int(num_threads)))

    def load(self, config: bytes | WorkerConfig, group_rank: bytes | None = None) -> bytes:
        """Loads the model; ``config`` is a msgpack-encoded ``WorkerConfig``;
        ``group_rank`` (a msgpack-encoded ``GroupRank``) makes this worker one rank of a
        model-parallel group, loading its shard. Returns the msgpack-encoded
        ``WorkerInfo``."""
        return self._run(self._load, config, group_rank)

    def _load(self, config: bytes | WorkerConfig, group_rank: bytes | None = None) -> bytes:
        from worker.build import build_runner
        from worker.protocol import GroupRank

        if isinstance(config, (bytes, bytearray)):
            config = msgspec.msgpack.decode(config, type=WorkerConfig)
        rank = msgspec.msgpack.decode(group_rank, type=GroupRank) if group_rank is not None else None
        threads = config.worker_num_threads or _assigned_cpus()
        if threads:
            # Ray starts actors with OMP_NUM_THREADS=num_cpus, but torch may have been
            # initialised before; say it explicitly.
            torch.set_num_threads(threads)
        self._runner = build_runner(config, rank, store=getattr(self, "_store", None))
        if self._runner.device.type == "cpu" and config.cpu_worker_niceness is not None:
            set_niceness(config.cpu_worker_niceness)  # after the load: torch's threads exist
        return msgspec.msgpack.encode(self._runner.info)

    def step(self, message: bytes) -> bytes:
        return self._run(self._step, message)

    def _step(self, message: bytes) -> bytes:
        if self._runner is None:
            raise RuntimeError("step before load: call load(config) first")
        started = time.perf_counter()
        reply = self._runner.execute(self._codec.decode_step(message), started)
        self._steps += 1
        return self._codec.encode(reply)

    # -- a model-parallel group ---------------------------------------------------------

    def rendezvous_address(self, world_size: int, timeout_s: float = 60.0) -> str:
        """Opens the group's rendezvous (torch's TCP store, on a port the OS picks, so no
        other process can take it first) and returns ``tcp://ip:port``; this worker is
        the group's rank 0 and joins through it at load."""
        import datetime

        import torch.distributed as dist

        host = channel_host()
        self._store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return f"tcp://{host}:{self._store.port}"

    def open_channel(self, reply: bool = True) -> ChannelAddress:
        """Opens a step channel for one engine to connect to (a channel opened before
        is closed); its steps run until the next reset. ``reply=False``: a rank of a
        model-parallel group that is not its leader; it runs the steps sent to the
        whole group and answers nothing (the leader answers for the group; a rank that
        fails breaks the group's collectives, and the leader reports that)."""
        if self._compute is None:
            raise RuntimeError("this worker was started without a compute thread (step_channel off)")
        self._close_channel()
        generation = self._generation
        self._channel = StepChannelServer(
            lambda conn: self._compute.attach(conn, lambda m: self._channel_step(m, generation, reply)),
            channel_host(),
        )
        return self._channel.address

    def _channel_step(self, message: bytes, generation: int, reply: bool = True) -> bytes | None:
        if generation != self._generation:  # read before a reset that ran first
            raise StaleStep("the step channel was closed by a reset")
        if reply:
            return self._step(message)
        try:
            self._step(message)
        except Exception:
            logger.exception("a step of this group's rank failed")
        return None

    def health(self) -> dict[str, Any]:
        runner = self._runner
        return {
            "torch_threads": torch.get_num_threads(),
            "loaded": runner is not None,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            "steps": self._steps,
            "uptime_s": time.time() - self._started,
            "batch_size": runner.batch.batch_size if runner else 0,
            "model": runner.info.model_name if runner else None,
            "device": runner.info.device if runner else None,
            # a rank of a model-parallel group: its place and how its all-reduce runs
            "group": runner.group.describe() if runner is not None and runner.group is not None else None,
        }

    def memory(self) -> dict[str, int]:
        if self._runner is None:
            return {}
        return self._runner.memory()

    def timings(self) -> dict[str, float]:
        """Seconds in the last step's parts (what its reply's ``timings`` said)."""
        t = self._runner.timings if self._runner else None
        return {} if t is None else msgspec.structs.asdict(t)

    def reset(self) -> None:
        """Forgets every request; the model stays loaded. It closes the step channel:
        a step still queued there must not run on the reset batch (the engine opens a
        new one)."""
        self._close_channel()
        self._run(self._reset)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _reset(self) -> None:
        self._generation += 1
        if self._runner is not None:
            self._runner.reset()


def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


def _usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _assigned_cpus() -> int | None:
    """The CPUs Ray gave this actor (None outside an actor, e.g. a Worker in a test)."""
    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(round(cpus))) if cpus else None


def create_worker(
    num_gpus: float = 0,
    num_cpus: float = 1,
    resources: dict[str, float] | None = None,
    compute_thread: bool = True,
    **options: Any,
) -> ray.actor.ActorHandle:
    """A ``Worker`` actor; a GPU actor when ``num_gpus`` > 0. Extra ``options`` go to
    ``.options()`` (name, scheduling_strategy, runtime_env, ...)."""
    cls = ray.remote(Worker)
    return cls.options(
        num_gpus=num_gpus, num_cpus=num_cpus, resources=resources or {},
        max_restarts=0, max_task_retries=0, **options,
    ).remote(compute_thread)


def decode_info(data: bytes) -> WorkerInfo:
    return msgspec.msgpack.decode(data, type=WorkerInfo)
