"""AttentionPlan: how one step's packed tokens map onto rows, KV blocks and slots.

Built once per step by the runner and handed to every layer's attention call (through
transformers' attention interface, or the CPU fused decoder). It carries the attention
kernel the runner chose for its device (``kernel``: the CPU paged kernel, or None for
the device-agnostic torch path), so nothing about attention lives in a module global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from worker.runner.kv_pool import PagedKVCache

#: Queries up to this many tokens per row join the batched attention call.
BATCHED_QUERY_MAX = 16


class PagedKernel(Protocol):
    """An attention path that reads the pool through the rows' block tables in place:
    the CPU kernel (``worker.cpu.paged_attention.CpuPagedKernel``) or FlexAttention
    (``worker.gpu.flex_attention.FlexPagedAttention``)."""

    def prepare(self, plan: AttentionPlan, block_table: np.ndarray, rows: np.ndarray, num_computed: np.ndarray,
                num_tokens: np.ndarray, static: bool = False) -> Any:
        """Per-step state every layer's call shares (``plan.kernel_state``), from the
        arguments of ``AttentionPlan.build``; ``static``: shapes that depend on the batch
        size only (for CUDA graphs)."""

    def attend(self, q_all: torch.Tensor, plan: AttentionPlan, layer: int, scale: float, window: int | None,
               softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's attention output ``[T, heads, dim]`` (``sinks``: the heads'
        attention sinks, ``[heads]``); None where this path does not apply (then the
        torch path serves)."""


@dataclass
class PrefillChunk:
    row: int
    start: int  # first packed token index
    num_tokens: int
    kv_len: int  # cached tokens after this chunk
    block_ids: torch.Tensor  # [blocks] the row's blocks covering kv_len


def as_long(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def as_int(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)


@dataclass
class AttentionPlan:
    """How one step's packed tokens map onto rows, blocks and slots (shared by all
    layers of one forward)."""

    cache: PagedKVCache
    # The packing, on the host: row i's tokens start at starts[i] of the sequence.
    starts: np.ndarray  # [rows]
    host_token_rows: np.ndarray  # [T]
    host_token_positions: np.ndarray  # [T]
    token_positions: torch.Tensor  # [T] position of each packed token in its row
    # [T * kv_heads] where token t's head h goes in a pool seen as [blocks * kv_heads *
    # block_size, head_dim] rows: the step's keys and values go in with one index_copy_
    # per pool.
    slot_rows: torch.Tensor
    # Rows with short queries, attended together.
    num_batched: int
    batched_index: torch.Tensor  # [B, Q] packed index of each query (pads point at 0)
    batched_valid: torch.Tensor  # [B * Q] bool, real queries
    batched_block_table: torch.Tensor  # [B, max blocks] int32 (pads point at block 0)
    batched_kv_lens: torch.Tensor  # [B] int32 tokens each row attends to (this step's included)
    batched_query_lens: torch.Tensor  # [B] int32
    host_batched_kv_lens: np.ndarray
    host_batched_query_lens: np.ndarray
    batched_query_len: int  # Q: the longest query
    prefill: list[PrefillChunk]
    # The paged kernel of the runner's device (None: the torch path everywhere) and what
    # it prepared for this step.
    kernel: PagedKernel | None = None
    kernel_state: Any = None
    #: the device the plan is for when its tensors were left on the host (``on_host``):
    #: a CUDA graph's refill copies them into its own
    for_device: torch.device | None = None
    #: the layers whose attention ran under this plan, when it is the load's probe
    #: (None: not recorded)
    seen_layers: set[int] | None = None

    @property
    def device(self) -> torch.device:
        """The device the step runs on (the kernel shapes its state for it)."""
        return self.for_device or self.token_positions.device

    @classmethod
    def build(
        cls,
        cache: PagedKVCache,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_tokens: np.ndarray,
        block_table: np.ndarray,
        device: torch.device,
        kernel: PagedKernel | None = None,
        static: bool = False,
        on_host: bool = False,
    ) -> AttentionPlan:
        """``rows[i]`` runs ``num_tokens[i]`` tokens after ``num_computed[i]`` cached
        ones, through its blocks ``block_table[rows[i]]``; the packed sequence holds row
        ``rows[0]``'s tokens first, and so on. ``kernel``: the paged kernel attention
        uses where it applies; ``static``: its state shaped by the batch size only;
        ``on_host``: the tensors are left on the host (shaped for ``device``), to be
        copied into a CUDA graph's inputs without a host-device round trip each."""
        for_device = device if on_host and device.type != "cpu" else None
        if on_host:
            device = torch.device("cpu")
        bs = cache.block_size
        starts = (np.cumsum(num_tokens) - num_tokens).astype(np.int64)
        token_rows = np.repeat(rows, num_tokens)
        token_positions = concat_ranges(num_computed, num_tokens)
        slot_blocks = block_table[token_rows, token_positions // bs]
        heads = np.arange(cache.num_kv_heads, dtype=np.int64)
        slot_rows = ((slot_blocks.astype(np.int64)[:, None] * cache.num_kv_heads + heads[None, :]) * bs
                     + (token_positions % bs)[:, None]).reshape(-1)
        short = num_tokens <= BATCHED_QUERY_MAX
        b_rows, b_start, b_n = rows[short], starts[short], num_tokens[short]
        b_kv = num_computed[short] + b_n
        nb = len(b_rows)
        q = int(b_n.max()) if nb else 0
        qi = np.arange(q)
        index = b_start[:, None] + qi[None, :]
        valid = qi[None, :] < b_n[:, None]
        index = np.where(valid, index, 0)
        max_blocks = -(-int(b_kv.max()) // bs) if nb else 0
        b_table = block_table[b_rows, :max_blocks] if nb else np.zeros((0, 0), np.int32)
        prefill = []
        for r, s, n, c in zip(rows[~short], starts[~short], num_tokens[~short], num_computed[~short]):
            kv_len = int(c + n)
            ids = as_long(block_table[r, : -(-kv_len // bs)], device)
            prefill.append(PrefillChunk(int(r), int(s), int(n), kv_len, ids))
        long = lambda a: as_long(a, device)
        int32 = lambda a: as_int(a, device)
        plan = cls(
            cache=cache,
            starts=starts,
            host_token_rows=token_rows,
            host_token_positions=token_positions,
            token_positions=long(token_positions),
            slot_rows=long(slot_rows),
            num_batched=nb,
            batched_index=long(index),
            batched_valid=torch.from_numpy(valid.reshape(-1)).to(device),
            batched_block_table=int32(b_table),
            batched_kv_lens=int32(b_kv),
            batched_query_lens=int32(b_n),
            host_batched_kv_lens=b_kv,
            host_batched_query_lens=b_n,
            batched_query_len=q,
            prefill=prefill,
            kernel=kernel,
            for_device=for_device,
        )
        if kernel is not None:
            plan.kernel_state = kernel.prepare(plan, block_table, rows, num_computed, num_tokens, static=static)
        return plan


def concat_ranges(first: np.ndarray, width: np.ndarray) -> np.ndarray:
    """``concatenate([arange(f, f + w) for f, w in zip(first, width)])``, vectorised."""
    width = np.asarray(width, dtype=np.int64)
    offsets = np.arange(int(width.sum()), dtype=np.int64) - np.repeat(np.cumsum(width) - width, width)
    return np.repeat(np.asarray(first, dtype=np.int64), width) + offsets
