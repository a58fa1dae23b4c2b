"""The CPU paged-attention kernel's Python face: what attention calls (through the
step's plan) for the rows it applies to.

Short-query rows (decodes, speculative verification) attend through their block tables
in place, one task per (row, KV head) on torch's own thread pool, with an online
softmax; prefill chunks as runs of ``prefill_queries`` queries in one packed call. The
torch path in ``worker/runner/attention.py`` (gather the blocks, then SDPA) is the
reference it is tested against and the fallback wherever it does not apply (other
devices, other dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from worker.runner.attention_plan import as_int, concat_ranges

if TYPE_CHECKING:
    from worker.runner.attention_plan import AttentionPlan

#: Prefill chunks are cut into kernel rows of this many queries.
PREFILL_QUERIES = 32


@dataclass
class KernelRows:
    """A step's rows as rows of the paged kernel, attended in one call that reads the
    packed queries and writes the packed outputs in place: short-query rows as they
    are, longer ones (prefill chunks) cut into runs of at most ``kernel.prefill_queries``
    queries, a run attending its row's keys up to its own last query (so the causal
    future of a chunk is never read)."""

    starts: torch.Tensor  # [R] int32 packed index of each kernel row's first query
    block_table: torch.Tensor  # [R, max blocks] int32: its sequence row's table
    kv_lens: torch.Tensor  # [R] int32 keys each kernel row attends to (its own last query's)
    query_lens: torch.Tensor  # [R] int32

    @classmethod
    def build(cls, rows: np.ndarray, starts: np.ndarray, num_tokens: np.ndarray, kv_lens: np.ndarray,
              block_table: np.ndarray, block_size: int, queries: int, device: torch.device) -> KernelRows:
        """Sequence row ``rows[i]`` runs ``num_tokens[i]`` packed tokens from
        ``starts[i]`` on and has ``kv_lens[i]`` keys after them."""
        runs = -(-num_tokens // queries)
        of = np.repeat(np.arange(len(rows)), runs)
        offset = concat_ranges(np.zeros(len(rows), dtype=np.int64), runs) * queries
        q_lens = np.minimum(queries, num_tokens[of] - offset)
        run_kv = kv_lens[of] - num_tokens[of] + offset + q_lens
        table = block_table[rows[of], : -(-int(run_kv.max()) // block_size)]
        return cls(starts=as_int(starts[of] + offset, device), block_table=as_int(table, device),
                   kv_lens=as_int(run_kv, device), query_lens=as_int(q_lens, device))


class CpuPagedKernel:
    """The compiled kernel (``module``: the loaded extension) as the attention plan's
    ``kernel``. ``prefill_queries``: queries per kernel row of a prefill chunk (0: prefill
    chunks take the torch path)."""

    def __init__(self, module: Any, prefill_queries: int = PREFILL_QUERIES) -> None:
        if prefill_queries < 1:
            raise ValueError(f"prefill_queries must be >= 1, got {prefill_queries}")
        self.module = module
        self.prefill_queries = prefill_queries

    def prepare(self, plan: AttentionPlan, block_table: np.ndarray, rows: np.ndarray, num_computed: np.ndarray,
                num_tokens: np.ndarray, static: bool = False) -> KernelRows | None:
        """A step with prefill chunks: every row as kernel rows (one packed call per
        layer); a step of short rows only: None (the plan's batched rows serve)."""
        if not plan.prefill:
            return None
        return KernelRows.build(rows, plan.starts, num_tokens, num_computed + num_tokens, block_table,
                                plan.cache.block_size, self.prefill_queries, plan.token_positions.device)

    def attend(self, q_all: torch.Tensor, plan: AttentionPlan, layer: int, scale: float, window: int | None,
               softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        k_pool, v_pool = plan.cache.keys[layer], plan.cache.values[layer]
        if not self.applies(q_all, k_pool):
            return None
        rows: KernelRows | None = plan.kernel_state
        if rows is not None:  # prefill chunks (and decodes): one call, in place
            return self.run_packed(q_all, k_pool, v_pool, rows.block_table, rows.kv_lens, rows.query_lens, rows.starts,
                                   scale, softcap, window, sinks)
        batched = (plan.batched_block_table, plan.batched_kv_lens, plan.batched_query_lens)
        if plan.batched_query_len == 1:  # every row a single decode: already the kernel's layout
            return self.run(q_all, k_pool, v_pool, *batched, scale, softcap, window, sinks)
        # Short query runs (speculative drafts): padded to the longest, then packed back.
        b, q_len = plan.num_batched, plan.batched_query_len
        heads, dim = q_all.shape[1], q_all.shape[2]
        o = self.run(q_all[plan.batched_index].view(b * q_len, heads, dim), k_pool, v_pool, *batched, scale, softcap,
                     window, sinks)
        out = q_all.new_empty(q_all.shape)
        out[plan.batched_index.reshape(-1)[plan.batched_valid]] = o[plan.batched_valid].to(out.dtype)
        return out

    @staticmethod
    def applies(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k_pool.dtype == q.dtype

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
            kv_lens: torch.Tensor, query_lens: torch.Tensor, scale: float, softcap: float | None,
            window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q [B * Q, heads, D]`` (row b's queries are the last ``query_lens[b]`` of its
        ``kv_lens[b]`` positions) -> ``[B * Q, heads, D]`` (rows past a row's queries
        are zeros)."""
        out = torch.zeros(q.shape, dtype=torch.float32)
        self.module.paged_attention(
            out, q.contiguous(), k_pool, v_pool, block_table, kv_lens, query_lens,
            float(scale), float(softcap or 0.0), int(window or 0), _sinks(sinks),
        )
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def run_packed(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                   kv_lens: torch.Tensor, query_lens: torch.Tensor, starts: torch.Tensor, scale: float,
                   softcap: float | None, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, heads, D]``, the step's packed queries (a token's heads contiguous,
        tokens any stride apart: a column view of the merged q/k/v projection is read
        as it is); kernel row b's queries are tokens ``starts[b]`` on, the last
        ``query_lens[b]`` of its ``kv_lens[b]`` positions; every token must belong to
        one row. -> ``[T, heads, D]``."""
        if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=torch.float32)
        self.module.paged_attention_packed(
            out, q, k_pool, v_pool, block_table, kv_lens, query_lens, starts,
            float(scale), float(softcap or 0.0), int(window or 0), _sinks(sinks),
        )
        return out if q.dtype == torch.float32 else out.to(q.dtype)


_NO_SINKS = torch.empty(0)


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor:
    """The heads' sinks as the kernel takes them: float32 ``[heads]``, or empty for none."""
    return _NO_SINKS if sinks is None else sinks.detach().float().contiguous()
