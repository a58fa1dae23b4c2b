"""The paged KV cache and the attention function that reads and writes it.

Storage: per layer, keys and values for ``num_blocks`` blocks of ``block_size`` token
slots, ``[num_blocks, kv_heads, block_size, head_dim]``. The driver's ``BlockManager``
decides which blocks a sequence holds; the worker keeps each row's block table
(``InputBatch.block_table``) and reads the pool through it. A token at position ``p`` of
a row lives in slot ``p % block_size`` of the row's block ``table[p // block_size]``.
Blocks are shared between rows (a cached prefix) and never copied: a row only writes
positions past what it found cached, which start a block of its own.

The model runs unchanged through transformers' ``AttentionInterface``: each layer's
attention call gets the step's ``AttentionPlan`` (the packed tokens' slots and, per
row, its block table and lengths) and

1. writes the step's keys and values into their slots;
2. attends for rows with short queries (decodes, speculative verification) together,
   with the CPU paged kernel (``worker/paged_attention``: reads each row's blocks in
   place) when it is built and applies, else by gathering the rows' blocks and one
   batched ``scaled_dot_product_attention`` (the device-agnostic reference path: the
   same code runs on CUDA);
3. attends for long prefill chunks: with the CPU kernel, every chunk cut into runs of
   ``KERNEL_PREFILL_QUERIES`` queries and attended in one kernel call with the step's
   short-query rows (``KernelRows``: each run reads its row's keys up to its own last
   query, so a causal chunk's masked half is mostly never computed, and the runs
   spread over the threads; the call reads the packed queries and writes the packed
   outputs in place, nothing gathered or scattered around it); elsewhere row by row
   (gather the row's blocks, then SDPA).

Sliding windows (Mistral, Qwen2, Gemma's local layers) and logit soft-capping (Gemma 2)
come as the attention call's ``sliding_window`` / ``softcap`` arguments and are applied
on every path. Features the paged path does not implement are refused when the model
loads (``check_attention_features``), never silently ignored.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "raydecode_paged"
#: Queries up to this many tokens per row join the batched attention call.
BATCHED_QUERY_MAX = 16
#: With the CPU kernel, prefill chunks are cut into kernel rows of this many queries
#: (``AttentionPlan.kernel_rows``); 0 keeps them on the gather + SDPA path.
KERNEL_PREFILL_QUERIES = 32

#: Config attributes of attention behaviours the paged path does not implement.
UNSUPPORTED_CONFIG = {
    "attention_chunk_size": "chunked local attention (Llama 4)",
    "use_bidirectional_attention": "bidirectional attention",
    "alibi": "ALiBi position biases",
}
#: Attention-call arguments that change the result and that the paged path does not
#: implement (seen in the load-time probe).
UNSUPPORTED_ARGUMENTS = {
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "additive position biases",
}


class UnsupportedAttention(ValueError):
    """The model needs an attention feature the paged path does not implement."""


class PagedKVCache:
    """Key/value storage: ``num_blocks`` blocks of ``block_size`` slots per layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        prefault: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.keys = [_lazy_zeros(shape, dtype, device, prefault) for _ in range(num_layers)]
        self.values = [_lazy_zeros(shape, dtype, device, prefault) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * block_size * torch.empty(0, dtype=dtype).element_size()

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                prefault: bool = False) -> torch.Tensor:
    """Zeros; on CPU an anonymous mapping, so the OS commits pages only as blocks are
    first used (a pool sized for long requests costs what the requests touch), asked
    for transparent huge pages: a 512-token prefill writes ~400 KB per layer into fresh
    blocks, and with 4 KB pages the faults alone cost ~1.2 ms per layer here (2 MB pages:
    512x fewer faults). ``prefault``: every page committed now, by writing the zeros
    (after the huge-page advice, so the pages are huge ones): on this project's VMs a
    first touch costs ~1 s per GiB, which the first requests would otherwise pay (an
    e2e run allocates ~1.2 GB of fresh blocks)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size = int(np.prod(shape)) * itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # no THP on this kernel: 4 KB pages
            pass
    raw = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive
    pool = torch.from_numpy(raw)
    if prefault:
        pool.zero_()  # torch's fill: over its threads
    return pool.view(dtype).view(shape)


@dataclass
class PrefillChunk:
    row: int
    start: int  # first packed token index
    num_tokens: int
    kv_len: int  # cached tokens after this chunk
    block_ids: torch.Tensor  # [blocks] the row's blocks covering kv_len


def _long(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _int(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)


@dataclass
class KernelRows:
    """A step's rows as rows of the CPU kernel, attended in one call that reads the
    packed queries and writes the packed outputs in place: short-query rows as they
    are, longer ones (prefill chunks) cut into runs of at most ``KERNEL_PREFILL_QUERIES``
    queries, a run attending its row's keys up to its own last query (so the causal
    future of a chunk is never read)."""

    starts: torch.Tensor  # [R] int32 packed index of each kernel row's first query
    block_table: torch.Tensor  # [R, max blocks] int32: its sequence row's table
    kv_lens: torch.Tensor  # [R] int32 keys each kernel row attends to (its own last query's)
    query_lens: torch.Tensor  # [R] int32

    @classmethod
    def build(cls, rows: np.ndarray, starts: np.ndarray, num_tokens: np.ndarray, kv_lens: np.ndarray,
              block_table: np.ndarray, block_size: int, queries: int, device: torch.device) -> "KernelRows":
        """Sequence row ``rows[i]`` runs ``num_tokens[i]`` packed tokens from
        ``starts[i]`` on and has ``kv_lens[i]`` keys after them."""
        runs = -(-num_tokens // queries)
        of = np.repeat(np.arange(len(rows)), runs)
        offset = concat_ranges(np.zeros(len(rows), dtype=np.int64), runs) * queries
        q_lens = np.minimum(queries, num_tokens[of] - offset)
        run_kv = kv_lens[of] - num_tokens[of] + offset + q_lens
        table = block_table[rows[of], : -(-int(run_kv.max()) // block_size)]
        return cls(starts=_int(starts[of] + offset, device), block_table=_int(table, device),
                   kv_lens=_int(run_kv, device), query_lens=_int(q_lens, device))


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
    # Where the CPU kernel is on and the step has prefill chunks: every row of the step
    # as kernel rows (else None; the batched rows and the chunks above serve).
    kernel_rows: KernelRows | None = None

    @classmethod
    def build(
        cls,
        cache: PagedKVCache,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_tokens: np.ndarray,
        block_table: np.ndarray,
        device: torch.device,
    ) -> "AttentionPlan":
        """``rows[i]`` runs ``num_tokens[i]`` tokens after ``num_computed[i]`` cached
        ones, through its blocks ``block_table[rows[i]]``; the packed sequence holds row
        ``rows[0]``'s tokens first, and so on."""
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
            ids = _long(block_table[r, : -(-kv_len // bs)], device)
            prefill.append(PrefillChunk(int(r), int(s), int(n), kv_len, ids))
        kernel_rows = None
        if prefill and cpu_kernel is not None and device.type == "cpu" and KERNEL_PREFILL_QUERIES > 0:
            kernel_rows = KernelRows.build(rows, starts, num_tokens, num_computed + num_tokens, block_table, bs,
                                           KERNEL_PREFILL_QUERIES, device)
        as_long = lambda a: _long(a, device)
        as_int = lambda a: _int(a, device)
        return cls(
            cache=cache,
            starts=starts,
            host_token_rows=token_rows,
            host_token_positions=token_positions,
            token_positions=as_long(token_positions),
            slot_rows=as_long(slot_rows),
            num_batched=nb,
            batched_index=as_long(index),
            batched_valid=torch.from_numpy(valid.reshape(-1)).to(device),
            batched_block_table=as_int(b_table),
            batched_kv_lens=as_int(b_kv),
            batched_query_lens=as_int(b_n),
            host_batched_kv_lens=b_kv,
            host_batched_query_lens=b_n,
            batched_query_len=q,
            prefill=prefill,
            kernel_rows=kernel_rows,
        )


def concat_ranges(first: np.ndarray, width: np.ndarray) -> np.ndarray:
    """``concatenate([arange(f, f + w) for f, w in zip(first, width)])``, vectorised."""
    width = np.asarray(width, dtype=np.int64)
    offsets = np.arange(int(width.sum()), dtype=np.int64) - np.repeat(np.cumsum(width) - width, width)
    return np.repeat(np.asarray(first, dtype=np.int64), width) + offsets


def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[..., blocks]`` block ids -> ``[..., kv_heads, blocks * block_size, head_dim]``:
    the rows' keys (or values) in position order, copied out of the pool."""
    lead = block_ids.shape[:-1]
    nb = block_ids.shape[-1]
    _, heads, bs, dim = pool.shape
    picked = pool.index_select(0, block_ids.reshape(-1).long()).view(*lead, nb, heads, bs, dim)
    return picked.transpose(-4, -3).reshape(*lead, heads, nb * bs, dim)


def visible(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """``[..., Q, kv_len]`` bool: key j is visible from a query at position ``q_pos``
    (causal, and within the sliding window: ``j > q_pos - window``, transformers'
    rule)."""
    kv = torch.arange(kv_len, device=q_pos.device)
    mask = kv <= q_pos.unsqueeze(-1)
    if window:
        mask &= kv > (q_pos.unsqueeze(-1) - window)
    return mask


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """``q [B, kv_heads, G*Q, D]`` against ``k, v [B, kv_heads, L, D]`` under ``mask``
    (broadcastable to ``[B, 1|kv_heads, G*Q, L]``): SDPA, or the written-out math when
    scores are soft-capped (``softcap * tanh(s / softcap)``, Gemma 2)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


#: The CPU paged kernel, once built (worker.paged_attention sets it; None: torch path).
cpu_kernel = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attention_plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, heads, T, dim]``, ``key``/``value`` ``[1, kv_heads, T, dim]`` for
    the step's packed tokens; returns ``[1, T, heads, dim]``."""
    plan = attention_plan
    if plan is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the step's attention_plan")
    for name, feature in UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"the model uses {feature} ({name}), which the paged attention does not implement")
    layer = module.layer_idx
    k_pool, v_pool = plan.cache.keys[layer], plan.cache.values[layer]
    rows = k_pool.shape[0] * k_pool.shape[1] * k_pool.shape[2]
    k_pool.view(rows, -1).index_copy_(0, plan.slot_rows, key[0].transpose(0, 1).reshape(-1, key.shape[-1]).to(k_pool.dtype))
    v_pool.view(rows, -1).index_copy_(0, plan.slot_rows, value[0].transpose(0, 1).reshape(-1, value.shape[-1]).to(v_pool.dtype))
    window = int(sliding_window) if sliding_window else None
    out = attend_cached(query[0].transpose(0, 1), plan, layer, scaling, window, softcap)
    return out.unsqueeze(0), None


def attend_cached(
    q_all: torch.Tensor, plan: AttentionPlan, layer: int, scaling: float | None,
    window: int | None, softcap: float | None,
) -> torch.Tensor:
    """Attention for the step's packed queries ``q_all`` ``[T, heads, dim]`` over layer
    ``layer``'s pool, the step's own keys and values already written; ``[T, heads,
    dim]``. Short-query rows together (the CPU kernel, else gathering), prefill chunks
    row by row."""
    k_pool, v_pool = plan.cache.keys[layer], plan.cache.values[layer]
    total, heads, dim = q_all.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    kernel = cpu_kernel
    on_kernel = kernel is not None and kernel.applies(q_all, k_pool)
    batched = (plan.batched_block_table, plan.batched_kv_lens, plan.batched_query_lens)
    if plan.num_batched == total and plan.batched_query_len == 1 and on_kernel:
        # Every row a single decode: the packed queries are already the kernel's layout.
        return kernel.run(q_all, k_pool, v_pool, *batched, scale, softcap, window)
    rows = plan.kernel_rows
    if rows is not None and on_kernel:  # prefill chunks (and decodes): one call, in place
        return kernel.run_packed(q_all, k_pool, v_pool, rows.block_table, rows.kv_lens, rows.query_lens, rows.starts,
                                 scale, softcap, window)
    out = q_all.new_empty(total, heads, dim)

    if plan.num_batched:
        b, q_len = plan.num_batched, plan.batched_query_len
        q = q_all[plan.batched_index].view(b * q_len, heads, dim)
        if on_kernel:
            o = kernel.run(q, k_pool, v_pool, *batched, scale, softcap, window)
        else:
            o = _batched_by_gathering(q, k_pool, v_pool, plan, scale, softcap, window)
        out[plan.batched_index.reshape(-1)[plan.batched_valid]] = o[plan.batched_valid].to(out.dtype)

    for chunk in plan.prefill:
        s, n = chunk.start, chunk.num_tokens
        q = q_all[s : s + n].transpose(0, 1).reshape(kv_heads, group * n, dim).unsqueeze(0)
        k = gather_blocks(k_pool, chunk.block_ids)[:, : chunk.kv_len].unsqueeze(0)
        v = gather_blocks(v_pool, chunk.block_ids)[:, : chunk.kv_len].unsqueeze(0)
        q_pos = torch.arange(chunk.kv_len - n, chunk.kv_len, device=q.device).repeat(group)
        if window is None and not softcap and chunk.kv_len == n:
            o = F.scaled_dot_product_attention(q.view(1, heads, n, dim), k, v, is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
            out[s : s + n] = o[0].transpose(0, 1).to(out.dtype)
            continue
        o = attend(q.to(k.dtype), k, v, visible(q_pos, chunk.kv_len, window), scale, softcap)
        out[s : s + n] = o.view(heads, n, dim).transpose(0, 1).to(out.dtype)
    return out


def _batched_by_gathering(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan,
    scale: float, softcap: float | None, window: int | None,
) -> torch.Tensor:
    """The reference path for short-query rows: gather every row's blocks into
    ``[B, kv_heads, L, D]`` and attend in one call. ``q`` is ``[B * Q, heads, D]``."""
    b, q_len = plan.num_batched, plan.batched_query_len
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    table = plan.batched_block_table
    kv_len = int(plan.host_batched_kv_lens.max())
    k = gather_blocks(k_pool, table)[:, :, :kv_len]
    v = gather_blocks(v_pool, table)[:, :, :kv_len]
    # [B, Q, heads, D] -> [B, kv_heads, group * Q, D]: a query group shares its key head.
    qq = q.view(b, q_len, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * q_len, dim)
    # Query j of a row sits at position kv_len - q_len + j; padding queries see key 0.
    q_pos = (plan.batched_kv_lens - plan.batched_query_lens).long().unsqueeze(1) + torch.arange(q_len, device=q.device)
    valid = plan.batched_valid.view(b, q_len)
    mask = visible(q_pos, kv_len, window)  # [B, Q, L]
    mask = torch.where(valid.unsqueeze(-1), mask, torch.arange(kv_len, device=q.device) == 0)
    mask = mask.unsqueeze(1).repeat(1, 1, group, 1) if q_len > 1 or group == 1 else mask.unsqueeze(1).expand(b, 1, group, kv_len)
    mask = mask.reshape(b, 1, group * q_len, kv_len)
    o = attend(qq.to(k.dtype), k, v, mask, scale, softcap)
    return o.view(b, kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(b * q_len, heads, dim)


def check_attention_features(config: object) -> None:
    """Refuses, naming the feature, a model config that asks for an attention
    behaviour the paged path does not implement."""
    configs = [config] + [getattr(config, name) for name in ("text_config",) if getattr(config, name, None) is not None]
    for cfg in configs:
        for attr, feature in UNSUPPORTED_CONFIG.items():
            if getattr(cfg, attr, None):
                raise UnsupportedAttention(f"the model uses {feature} ({attr}), which the paged attention does not implement")


AttentionInterface.register(ATTENTION_NAME, paged_attention)
