"""A shared-memory SUM all-reduce for tensor-parallel ranks on one CPU node.

The ranks (separate processes) map one file under ``/dev/shm``; each call copies the
rank's tensor into its buffer there, waits for the others' and sums every rank's in
rank order, so all ranks get bit-identical results (``csrc/shm_allreduce.cpp`` has the
protocol and why it is safe). Decode-sized messages take a small fraction of gloo's
time over loopback TCP (``tests/bench/allreduce.py``; docs/performance.md). A
waiting rank spins ~25 us, then sleeps on a futex until its peer publishes, so ranks
may share cores (slower, still correct).

Use::

    if ShmAllReduce.available():
        shm = ShmAllReduce.for_group(group)      # collective: every rank of the group
        shm.all_reduce(hidden)                    # in place, like dist.all_reduce
    else:
        dist.all_reduce(hidden, group=group)      # gloo

or by hand: rank 0 constructs first (it creates the file), the others with the same
path, world size and chunk size; then a barrier on the group, then rank 0's
``unlink()``: the file is gone from ``/dev/shm`` as soon as every rank has mapped it,
so nothing is left behind even when a rank crashes later.

Rules, as for any collective: every rank makes the same calls (same dtype and number
of elements) in the same order. One instance serves one thread at a time (concurrent
calls are serialized, and their order across ranks would be arbitrary). A wait that
outlasts ``timeout_s`` (a peer died) raises :class:`ShmAllReduceTimeout`; after that or
any other failure inside a call the instance is out of step and every later call
raises: fall back to gloo or tear the group down.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import torch

from worker.cpu import kernels

#: Bytes of each rank's chunk buffer (two per rank): a prefill's message (1-4 MB) in
#: one or a few exchanges.
DEFAULT_CHUNK_BYTES = 4 << 20
DTYPES = (torch.float32, torch.bfloat16)


class ShmAllReduceTimeout(TimeoutError):
    """A rank waited longer than ``timeout_s`` for a peer (or for rank 0's file)."""


def _ops() -> Any | None:
    return kernels.load() if sys.platform.startswith("linux") else None


class ShmAllReduce:
    """In-place SUM all-reduce of contiguous float32 / bfloat16 CPU tensors between
    the ``world_size`` ranks mapping the segment at ``path``."""

    @staticmethod
    def available() -> bool:
        """Whether the kernels are built here (else callers use gloo)."""
        return _ops() is not None

    def __init__(self, path: str, rank: int, world_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout_s: float = 60.0) -> None:
        ops = _ops()
        if ops is None:
            raise RuntimeError("the shm all-reduce needs the CPU kernels, which are not available here")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if chunk_bytes <= 0 or chunk_bytes % 64:
            raise ValueError(f"chunk_bytes must be a positive multiple of 64, not {chunk_bytes}")
        self.path, self.rank, self.world_size = path, rank, world_size
        self.chunk_bytes, self.timeout_s = chunk_bytes, float(timeout_s)
        size = ops.shm_segment_bytes(world_size, chunk_bytes)
        self._segment = self._create(ops, size) if rank == 0 else self._attach(ops, size)

    @classmethod
    def for_group(cls, group: Any = None, *, directory: str = "/dev/shm", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  timeout_s: float = 60.0) -> ShmAllReduce:
        """Collective over a torch.distributed ``group`` (None: the default one) whose
        ranks all run on this node: rank 0 picks a fresh path and broadcasts it, every
        rank attaches, a barrier, and rank 0 unlinks the file."""
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        name = [os.path.join(directory, f"raydecode-allreduce-{uuid.uuid4().hex}") if rank == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        shm = cls(name[0], rank, world, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
        dist.barrier(group)
        if rank == 0:
            shm.unlink()
        return shm

    def _create(self, ops: Any, size: int) -> Any:
        """A zero-filled file of the full size with its header written, renamed onto
        ``path`` at once: a rank that can open ``path`` finds it complete."""
        tmp = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve it now: a full /dev/shm fails here, not as SIGBUS later
            segment = ops.ShmAllReduceSegment(fd, self.rank, self.world_size, self.chunk_bytes, True)
            os.rename(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return segment

    def _attach(self, ops: Any, size: int) -> Any:
        deadline, pause = time.monotonic() + self.timeout_s, 0.001
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise ShmAllReduceTimeout(f"shm all-reduce: {self.path} did not appear within {self.timeout_s} s") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
                continue
            try:
                if os.fstat(fd).st_size != size:
                    raise ValueError(f"shm all-reduce: {self.path} is not a segment for {self.world_size} ranks "
                                     f"of {self.chunk_bytes}-byte chunks")
                return ops.ShmAllReduceSegment(fd, self.rank, self.world_size, self.chunk_bytes, False)
            finally:
                os.close(fd)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` = the sum of every rank's ``tensor``, in place (returned too)."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"shm all-reduce takes a tensor, not {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"shm all-reduce takes CPU tensors, not {tensor.device}")
        if tensor.dtype not in DTYPES:
            raise ValueError(f"shm all-reduce takes float32 or bfloat16 tensors, not {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError("shm all-reduce takes contiguous tensors (this one is strided)")
        if self._segment is None:
            raise ValueError("shm all-reduce: closed")
        try:
            self._segment.all_reduce(tensor, self.timeout_s)
        except TimeoutError as exc:  # the kernel's ShmAllReduceTimeout
            raise ShmAllReduceTimeout(str(exc)) from None
        return tensor

    def unlink(self) -> None:
        """Removes the file (rank 0, after a barrier: every rank has mapped it by then
        and keeps its mapping). Harmless when it is gone already."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmaps the segment (the file itself: ``unlink``)."""
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def __enter__(self) -> ShmAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
