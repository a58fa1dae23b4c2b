"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is bound by kernel launches: every layer's
dozen kernels are launched from Python. A CUDA graph records the whole forward (the
transformers model with FlexAttention reading the paged pool) once per bucket of batch
sizes and replays it with one launch. Only steps where every row decodes one token
qualify (no prefill chunk, no speculative draft, no prompt logprobs); anything else
runs eagerly, and the eager forward is the reference the graphs are tested against.

A graph reads and writes fixed memory, so each bucket keeps its own inputs: the token
ids and the attention plan's tensors (the positions, the KV slots, the FlexAttention
block mask and what its mask function reads), built with ``static=True`` so their shapes depend on the
bucket alone. A step's rows are padded to the bucket with rows that decode position 0
of the pool's scratch block (no request's block is touched), and only the real rows'
logits are returned. Graphs are captured when a bucket is first needed (a warm-up run,
then the capture); they share one memory pool.

A model the graphs cannot replay turns them off for the worker at the first capture,
with a warning, and its decode steps run eagerly: one whose attention kernel gives no
static plan (a block size its tiles cannot take), or with layers whose attention takes
the torch path (a window FlexAttention has not prepared calls for), whose inputs are
built on the host for each step and would be replayed stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.gpu.flex_attention import FlexPagedAttention
from worker.gpu.host_upload import HostUpload
from worker.runner.attention_plan import AttentionPlan
from worker.runner.kv_pool import PagedKVCache

logger = logging.getLogger(__name__)

#: Batch sizes a graph is captured for (the engine's max_num_seqs is always one).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

#: the runner's forward: token ids [T] (at the plan's positions), the plan, the packed
#: positions whose logits are wanted -> logits
Forward = Callable[[torch.Tensor, AttentionPlan, torch.Tensor], torch.Tensor]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None off CUDA: replay runs the forward on the same inputs
    input_ids: torch.Tensor  # [bucket]
    keep: torch.Tensor  # [bucket]
    plan: AttentionPlan
    logits: torch.Tensor  # [bucket, vocab], the graph's output
    windows: frozenset  # the attention kernel's windows when it was captured
    #: how each step refills the inputs (``input_ids``, then the plan's tensors)
    uploads: list[HostUpload] = field(init=False)

    def __post_init__(self) -> None:
        self.uploads = [HostUpload(t) for t in [self.input_ids, *_plan_tensors(self.plan)]]

    def replay(self, forward: Forward) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:  # the same recorded inputs, run eagerly (tests of the refill on a CPU)
            self.logits = forward(self.input_ids, self.plan, self.keep)
        return self.logits


class DecodeGraphs:
    #: build each step's plan on the host and copy it into the graph's inputs (False: on
    #: the device, then copied across; the benchmark's comparison)
    plan_on_host = True

    def __init__(self, forward: Forward, kv: PagedKVCache, kernel: FlexPagedAttention, max_rows: int,
                 device: torch.device, recorded: Forward | None = None) -> None:
        """``forward`` runs the decode steps the graphs decline; ``recorded`` (default:
        ``forward``) is what a graph records (off CUDA: what its replay runs), the
        model's RMSNorms compiled in it."""
        if kv.scratch_block is None:
            raise ValueError("CUDA graphs need a scratch block in the KV pool for padding rows")
        self.forward = forward
        self.recorded = recorded or forward
        self.kv = kv
        self.kernel = kernel
        self.device = device
        self.buckets = sorted({b for b in BUCKETS if b < max_rows} | {max_rows})
        self.graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        #: why this model's decode steps cannot be replayed (None: they can, so far)
        self.unusable: str | None = None

    def applies(self, num_rows: int, all_decode: bool) -> bool:
        return self.unusable is None and all_decode and 0 < num_rows <= self.buckets[-1]

    def run(self, input_ids: np.ndarray, positions: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one decode step: row ``i`` runs token
        ``input_ids[i]`` at ``positions[i]`` with block table ``tables[i]`` (its blocks
        cover ``positions[i] + 1`` tokens)."""
        rows = len(input_ids)
        bucket = next(b for b in self.buckets if b >= rows)
        graph = self.graphs.get(bucket)
        if graph is not None and graph.windows != frozenset(self.kernel.windows):
            self.graphs.clear()  # a window learned since the capture: its calls are not in the graphs
            graph = None
        if graph is None:
            try:
                graph = self.graphs[bucket] = self._capture(bucket, tables.shape[1])
            except CannotCapture as exc:
                self.unusable = str(exc)
                logger.warning("CUDA graphs are off for this model: %s; decode steps run eagerly", exc)
        plan = self._plan(bucket, positions, tables, on_host=graph is not None and self.plan_on_host)
        if graph is None or plan.kernel_state is None:  # the kernel declined this step: run it eagerly
            if plan.for_device is not None:
                plan = self._plan(bucket, positions, tables)
            ids = torch.from_numpy(np.pad(input_ids, (0, bucket - rows))).to(self.device)
            return self.forward(ids, plan, torch.arange(rows, device=self.device))
        # The graph's inputs refilled from the plan built on the host: one asynchronous
        # copy each, queued ahead of the replay.
        ids = torch.from_numpy(np.pad(input_ids.astype(np.int64), (0, bucket - rows)))
        for upload, new in zip(graph.uploads, [ids, *_plan_tensors(plan)], strict=True):
            upload.send_from(new)
        return graph.replay(self.recorded)[:rows]

    def _plan(self, bucket: int, positions: np.ndarray, tables: np.ndarray, on_host: bool = False) -> AttentionPlan:
        """The step's plan padded to ``bucket`` rows (padding: position 0 of the scratch
        block), with static shapes; ``on_host``: its tensors left on the host."""
        rows = len(positions)
        padded = np.full((bucket, tables.shape[1]), self.kv.scratch_block, dtype=tables.dtype)
        padded[:rows] = tables
        computed = np.zeros(bucket, dtype=np.int64)
        computed[:rows] = positions
        return AttentionPlan.build(self.kv, np.arange(bucket), computed, np.ones(bucket, dtype=np.int64), padded,
                                   self.device, self.kernel, static=True, on_host=on_host)

    def _capture(self, bucket: int, width: int) -> _Graph:
        input_ids = torch.zeros(bucket, dtype=torch.long, device=self.device)
        keep = torch.arange(bucket, device=self.device)
        plan = self._plan(bucket, np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.int32))
        if plan.kernel_state is None:
            raise CannotCapture(f"the attention kernel gives no static plan (KV blocks of {self.kv.block_size} tokens)")
        declined = self.kernel.declined
        if self.device.type != "cuda":
            logits = self.recorded(input_ids, plan, keep)
        else:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: compiles, allocator state
                for _ in range(2):
                    self.recorded(input_ids, plan, keep)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.kernel.declined != declined:
            raise CannotCapture("some layers' attention takes the torch path, whose inputs are "
                                "built on the host for each step")
        if self.device.type != "cuda":
            return _Graph(None, input_ids, keep, plan, logits, frozenset(self.kernel.windows))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.recorded(input_ids, plan, keep)
        return _Graph(graph, input_ids, keep, plan, logits, frozenset(self.kernel.windows))


class CannotCapture(RuntimeError):
    """This model's decode steps cannot be replayed from a graph."""


def _plan_tensors(plan: AttentionPlan) -> list[torch.Tensor]:
    """The plan's tensors that a decode forward reads (the positions, the KV slots, the
    attention calls'), in a fixed order."""
    tensors = [plan.slot_rows, plan.token_positions]
    for call in plan.kernel_state.calls:
        tensors += call.tensors()
    return tensors
