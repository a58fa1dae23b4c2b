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

from typing import Any

import torch

#: Prefill chunks are cut into kernel rows of this many queries.
PREFILL_QUERIES = 32


class CpuPagedKernel:
    """The compiled kernel (``module``: the loaded extension) as the attention plan's
    ``kernel``. ``prefill_queries``: queries per kernel row of a prefill chunk (0: prefill
    chunks take the torch path)."""

    def __init__(self, module: Any, prefill_queries: int = PREFILL_QUERIES) -> None:
        self.module = module
        self.prefill_queries = prefill_queries

    @staticmethod
    def applies(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k_pool.dtype == q.dtype

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
            kv_lens: torch.Tensor, query_lens: torch.Tensor, scale: float, softcap: float | None,
            window: int | None) -> torch.Tensor:
        """``q [B * Q, heads, D]`` (row b's queries are the last ``query_lens[b]`` of its
        ``kv_lens[b]`` positions) -> ``[B * Q, heads, D]`` (rows past a row's queries
        are zeros)."""
        out = torch.zeros(q.shape, dtype=torch.float32)
        self.module.paged_attention(
            out, q.contiguous(), k_pool, v_pool, block_table, kv_lens, query_lens,
            float(scale), float(softcap or 0.0), int(window or 0),
        )
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def run_packed(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                   kv_lens: torch.Tensor, query_lens: torch.Tensor, starts: torch.Tensor, scale: float,
                   softcap: float | None, window: int | None) -> torch.Tensor:
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
            float(scale), float(softcap or 0.0), int(window or 0),
        )
        return out if q.dtype == torch.float32 else out.to(q.dtype)
