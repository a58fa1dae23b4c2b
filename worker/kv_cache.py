"""The per-row KV cache and the attention function that reads and writes it.

Row ``r`` of the persistent batch owns slot ``r`` of every layer's key and value tensors
(``[rows, kv_heads, max_len, head_dim]``), so decode attention over rows ``0..n-1``
reads a view of the cache, with no gather. Moving a request to another row copies its
slot (moves happen only when the batch condenses after a finish).

The attention function is registered with transformers' ``AttentionInterface`` under
``ATTENTION_NAME``; the model runs unchanged (its projections, RoPE and MLP) on the
step's tokens packed into one sequence, and each layer's attention call receives the
step's ``AttentionPlan`` through the forward's keyword arguments. Rows with a short
query (decodes, speculative verification) attend in one batched SDPA call; long
prefill chunks attend one row at a time (their cost is in the matmuls anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "raydecode_rows"
#: Queries up to this many tokens per row join the batched (padded) attention call.
BATCHED_QUERY_MAX = 16


class RowKVCache:
    """Key/value storage for ``num_rows`` rows of up to ``max_len`` tokens each."""

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_rows = num_rows
        self.max_len = max_len
        shape = (num_rows, num_kv_heads, max_len, head_dim)
        self.keys = [_lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [_lazy_zeros(shape, dtype, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` takes the first ``length`` positions of slot ``src``."""
        if length:
            for cache in (*self.keys, *self.values):
                cache[dst, :, :length] = cache[src, :, :length]

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        n = max(length_a, length_b)
        if n:
            for cache in (*self.keys, *self.values):
                tmp = cache[a, :, :n].clone()
                cache[a, :, :n] = cache[b, :, :n]
                cache[b, :, :n] = tmp


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU from calloc'd memory, so the OS commits pages only as rows fill
    (a cache sized for long requests costs what the requests actually use)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


@dataclass
class PrefillChunk:
    row: int
    start: int  # first packed token index
    num_tokens: int
    kv_len: int  # cached tokens after this chunk
    mask: torch.Tensor | None  # [num_tokens, kv_len] bool (True = attend); None = plain causal


@dataclass
class AttentionPlan:
    """How one step's packed tokens map onto rows and cache positions (shared by all
    layers of one forward)."""

    cache: RowKVCache
    # The packing, on the host: row i's tokens start at starts[i] of the sequence.
    starts: np.ndarray  # [rows]
    host_token_rows: np.ndarray  # [T]
    host_token_positions: np.ndarray  # [T]
    token_rows: torch.Tensor  # [T] row of each packed token
    token_positions: torch.Tensor  # [T] position of each packed token in its row
    # Rows with short queries, attended together.
    batched_rows: torch.Tensor | None  # [B] rows; None when they are exactly 0..B-1
    num_batched: int
    batched_index: torch.Tensor  # [B, Q] packed index of each query (pads point at 0)
    batched_valid: torch.Tensor  # [B * Q] bool, real queries
    batched_mask: torch.Tensor  # [B, 1, Q, L] bool (True = attend)
    batched_kv_len: int
    batched_query_len: int
    prefill: list[PrefillChunk]

    @classmethod
    def build(
        cls,
        cache: RowKVCache,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_tokens: np.ndarray,
        device: torch.device,
    ) -> "AttentionPlan":
        """``rows[i]`` runs ``num_tokens[i]`` tokens after ``num_computed[i]`` cached
        ones; the packed sequence holds row ``rows[0]``'s tokens first, and so on."""
        starts = (np.cumsum(num_tokens) - num_tokens).astype(np.int64)
        token_rows = np.repeat(rows, num_tokens)
        token_positions = concat_ranges(num_computed, num_tokens)
        short = num_tokens <= BATCHED_QUERY_MAX
        b_rows, b_start, b_n = rows[short], starts[short], num_tokens[short]
        b_kv = num_computed[short] + b_n
        nb = len(b_rows)
        q = int(b_n.max()) if nb else 0
        kv = int(b_kv.max()) if nb else 0
        qi = np.arange(q)
        index = b_start[:, None] + qi[None, :]
        valid = qi[None, :] < b_n[:, None]
        index = np.where(valid, index, 0)
        # Query j of a row sits at position kv_len - n + j and sees keys up to there.
        last_visible = (b_kv - b_n)[:, None] + qi[None, :]
        mask = np.arange(kv)[None, None, :] <= last_visible[:, :, None]
        if nb:
            mask[~valid] = False
            mask[~valid, 0] = True  # padding queries attend somewhere (no NaNs), then dropped
        contiguous = nb > 0 and bool((b_rows == np.arange(nb)).all())
        prefill = []
        for r, s, n, c in zip(rows[~short], starts[~short], num_tokens[~short], num_computed[~short]):
            kv_len = int(c + n)
            chunk_mask = None
            if c:
                chunk_mask = torch.from_numpy(
                    np.arange(kv_len)[None, :] <= (c + np.arange(n))[:, None]
                ).to(device)
            prefill.append(PrefillChunk(int(r), int(s), int(n), kv_len, chunk_mask))
        as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
        return cls(
            cache=cache,
            starts=starts,
            host_token_rows=token_rows,
            host_token_positions=token_positions,
            token_rows=as_long(token_rows),
            token_positions=as_long(token_positions),
            batched_rows=None if contiguous or nb == 0 else as_long(b_rows),
            num_batched=nb,
            batched_index=as_long(index),
            batched_valid=torch.from_numpy(valid.reshape(-1)).to(device),
            batched_mask=torch.from_numpy(mask[:, None]).to(device),
            batched_kv_len=kv,
            batched_query_len=q,
            prefill=prefill,
        )


def concat_ranges(first: np.ndarray, width: np.ndarray) -> np.ndarray:
    """``concatenate([arange(f, f + w) for f, w in zip(first, width)])``, vectorised."""
    width = np.asarray(width, dtype=np.int64)
    offsets = np.arange(int(width.sum()), dtype=np.int64) - np.repeat(np.cumsum(width) - width, width)
    return np.repeat(np.asarray(first, dtype=np.int64), width) + offsets


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attention_plan: AttentionPlan | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, heads, T, dim]``, ``key``/``value`` ``[1, kv_heads, T, dim]`` for the
    step's packed tokens; returns ``[1, T, heads, dim]``."""
    plan = attention_plan
    if plan is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the step's attention_plan")
    layer = module.layer_idx
    k_cache, v_cache = plan.cache.keys[layer], plan.cache.values[layer]
    k_cache[plan.token_rows, :, plan.token_positions] = key[0].transpose(0, 1).to(k_cache.dtype)
    v_cache[plan.token_rows, :, plan.token_positions] = value[0].transpose(0, 1).to(v_cache.dtype)

    heads, total, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    q_all = query[0].transpose(0, 1)  # [T, heads, dim]
    out = query.new_empty(total, heads, dim)

    if plan.num_batched:
        b, q_len, kv_len = plan.num_batched, plan.batched_query_len, plan.batched_kv_len
        if plan.batched_rows is None:
            k, v = k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len]
        else:
            k, v = k_cache[plan.batched_rows, :, :kv_len], v_cache[plan.batched_rows, :, :kv_len]
        # [B, Q, heads, dim] -> [B, kv_heads, group * Q, dim]: a query group shares its
        # key head, so no key repeat is needed.
        q = q_all[plan.batched_index].view(b, q_len, kv_heads, group, dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * q_len, dim)
        mask = plan.batched_mask if q_len == 1 else plan.batched_mask.repeat(1, 1, group, 1)
        o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scaling)
        o = o.view(b, kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(b * q_len, heads, dim)
        flat_index = plan.batched_index.reshape(-1)[plan.batched_valid]
        out[flat_index] = o[plan.batched_valid].to(out.dtype)

    for chunk in plan.prefill:
        s, n = chunk.start, chunk.num_tokens
        q = q_all[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        k = k_cache[chunk.row, :, : chunk.kv_len].unsqueeze(0)
        v = v_cache[chunk.row, :, : chunk.kv_len].unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q.to(k.dtype), k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None,
            scale=scaling, enable_gqa=group > 1,
        )
        out[s : s + n] = o[0].transpose(0, 1).to(out.dtype)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, row_attention)
