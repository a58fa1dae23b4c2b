"""The collectives of one model-parallel group (``torch.distributed``).

One process group spans the group's ranks (gloo on CPU, NCCL on CUDA, chosen from the
device), with one tensor-parallel subgroup per pipeline stage. What a step needs:

- ``all_reduce``: the partial sums of the row-parallel projections, twice per layer.
  On CPU, when every rank of the stage is on one node, through a shared-memory segment
  (``worker/cpu/shm_allreduce.py``: no sockets, no extra copies, spins then yields)
  where it is available; gloo otherwise (and as the reference in tests);
- ``gather_logits``: each tensor rank's slice of the vocabulary, concatenated on the
  stage's tensor rank 0 (the leader, on the last stage);
- ``send_hidden`` / ``recv_hidden``: the hidden states crossing a stage boundary, tensor
  rank t of one stage to tensor rank t of the next;
- ``send_tokens`` / ``receive_tokens``: the leader's sampled tokens to every other rank
  (each keeps its persistent batch in step), point to point and without waiting: a
  rank collects them before it next needs them (``worker/runner/model_runner.py``), so
  an earlier pipeline stage starts the next batch while the leader still samples.

Every collective is bounded by ``timeout_s`` (the process group's timeout; the shared
segment checks a deadline while it waits), so the ranks left in a group whose rank died
raise instead of hanging, and the driver replaces the group.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from worker.parallel.layout import RankLayout, leader_rank
from worker.protocol import GroupRank

logger = logging.getLogger("raydecode")

T = TypeVar("T")

#: Point-to-point tags: a stage's hidden states, the leader's sampled tokens.
HIDDEN_TAG, TOKENS_TAG = 1, 2


class ParallelGroup:
    """This rank's view of its group's collectives (built once, at load)."""

    def __init__(self, rank: GroupRank, layout: RankLayout, device: torch.device, store: object | None = None) -> None:
        """``store``: rank 0's rendezvous store, already listening at ``init_method``
        (the other ranks connect to that address)."""
        self.layout = layout
        self.device = device
        self.timeout_s = rank.timeout_s
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=rank.timeout_s)
        if store is None:  # a client of rank 0's store (every rank joins through a store alike)
            host, _, port = rank.init_method.removeprefix("tcp://").rpartition(":")
            store = dist.TCPStore(host.strip("[]"), int(port), rank.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank.rank, world_size=rank.world_size,
                                timeout=timeout)
        self.backend = backend
        self.leader = leader_rank(layout.tp_size, layout.pp_size)
        # Every rank creates every stage's subgroup, in the same order (torch's rule).
        self.tp_group = None
        for stage in range(layout.pp_size):
            ranks = layout.stage_ranks(stage)
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=rank.timeout_s))
            if stage == layout.pp_rank:
                self.tp_group = group
        self.seconds = 0.0  # in collectives since ``take_seconds`` last ran
        self.shm = None
        if rank.shm_path and layout.tp_size > 1 and device.type == "cpu":
            self.shm = self._attach_shm(rank.shm_path)

    def _attach_shm(self, path: str):
        """The stage's shared segment; None (gloo serves) where the kernels are
        missing. Every tensor rank attaches before tensor rank 0 unlinks the file, so
        nothing is left in /dev/shm whatever happens later."""
        try:
            from worker.cpu.shm_allreduce import ShmAllReduce
        except ImportError:
            return None
        usable = ShmAllReduce.available()
        # All ranks of the stage agree (one of them without kernels: all use gloo).
        flag = torch.tensor([1 if usable else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.tp_group)
        if not int(flag.item()):
            logger.warning("the shared-memory all-reduce is not available: gloo serves")
            return None
        shm = ShmAllReduce(path, self.layout.tp_rank, self.layout.tp_size, timeout_s=self.timeout_s)
        dist.barrier(group=self.tp_group)
        if self.layout.tp_rank == 0:
            shm.unlink()
        return shm

    def _timed(self, fn: Callable[..., T], *args: object) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def take_seconds(self) -> float:
        """Seconds spent in collectives since the last call (one step's)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    # -- tensor parallel ----------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the stage's tensor ranks, in place; returns it."""
        if self.layout.tp_size == 1:
            return x
        if self.shm is not None and x.is_contiguous():
            self._timed(self.shm.all_reduce, x)
        else:
            self._timed(dist.all_reduce, x, dist.ReduceOp.SUM, self.tp_group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The full ``[rows, vocab_size]`` logits on tensor rank 0 from every rank's
        ``[rows, vocab_shard]`` slice; None on the other ranks."""
        if self.layout.tp_size == 1:
            return local[:, :vocab_size]
        local = local.contiguous()
        ranks = self.layout.stage_ranks()
        if self.layout.tp_rank == 0:
            parts = [torch.empty_like(local) for _ in ranks]
            self._timed(dist.gather, local, parts, ranks[0], self.tp_group)
            return torch.cat(parts, dim=1)[:, :vocab_size]
        self._timed(dist.gather, local, None, ranks[0], self.tp_group)
        return None

    # -- pipeline parallel ----------------------------------------------------------

    def send_hidden(self, h: torch.Tensor) -> None:
        """To the same tensor rank of the next stage."""
        self._timed(dist.send, h.contiguous(), self.layout.rank + self.layout.tp_size, None, HIDDEN_TAG)

    def recv_hidden(self, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """From the same tensor rank of the previous stage."""
        h = torch.empty(tokens, hidden, dtype=dtype, device=self.device)
        self._timed(dist.recv, h, self.layout.rank - self.layout.tp_size, None, HIDDEN_TAG)
        return h

    # -- the sampled tokens -----------------------------------------------------------

    def send_tokens(self, grid: torch.Tensor) -> list[object]:
        """The leader: its ``[rows, width]`` int32 table of what each sampling row emitted
        to every other rank, without waiting; the sends' handles (wait on them before
        the table is reused)."""
        grid = grid.to(self.device) if self.backend == "nccl" else grid
        return [dist.isend(grid, dst=r, tag=TOKENS_TAG) for r in range(self.layout.world_size) if r != self.leader]

    def receive_tokens(self, rows: int, width: int) -> tuple[object, torch.Tensor]:
        """Another rank: posts the receive of the leader's table (``send_tokens``);
        returns its handle and the table it fills."""
        grid = torch.empty(rows, width, dtype=torch.int32, device=self.device if self.backend == "nccl" else "cpu")
        return dist.irecv(grid, src=self.leader, tag=TOKENS_TAG), grid

    def wait(self, work: object) -> None:
        """Waits for a send or receive (bounded by the group's timeout)."""
        self._timed(work.wait)

    def describe(self) -> dict[str, object]:
        lay = self.layout
        return {"rank": lay.rank, "tp_rank": lay.tp_rank, "pp_rank": lay.pp_rank, "backend": self.backend,
                "all_reduce": "shared memory" if self.shm is not None else self.backend,
                "layers": [lay.first_layer, lay.first_layer + lay.num_layers]}

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group: the process is going anyway
                pass


def install_tensor_parallel_hooks(model: torch.nn.Module, group: ParallelGroup) -> int:
    """For the transformers forward of a shard: each layer's row-parallel projections
    (``self_attn.o_proj``, ``mlp.down_proj``, whatever modules serve them now, packed
    or not) all-reduce their output; a mixture-of-experts block (``mlp.experts``) its
    whole output, the experts' weighted sum (a tuple's first item). Returns the number
    of hooks (none at TP 1)."""
    if group.layout.tp_size == 1:
        return 0

    def reduce(_module: torch.nn.Module, _inputs: object, output: object) -> object:
        if isinstance(output, tuple):  # (hidden states, router scores)
            return (group.all_reduce(output[0]), *output[1:])
        return group.all_reduce(output)

    hooks = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        for module in (layer.self_attn.o_proj, mlp if hasattr(mlp, "experts") else mlp.down_proj):
            module.register_forward_hook(reduce)
            hooks += 1
    return hooks
