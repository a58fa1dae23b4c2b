"""Paged attention through torch's FlexAttention: the pool read in place, on any device.

The KV pool of a layer, ``[num_blocks, kv_heads, block_size, head_dim]``, is viewed
without a copy as one long key sequence of a single "head", ``[1, 1, num_blocks *
kv_heads * block_size, head_dim]``: tile ``t = block * kv_heads + head`` holds that
block's keys of that KV head, ``block_size`` rows. Each attention call runs over rows of
the step as a batch, a KV head's query heads folded into its query sequence (queries
``[rows, kv_heads, longest query x group, head_dim]``, gathered from the step's packed
queries; folded query ``i`` is query ``i // group`` of query head ``kv_head x group + i %
group``), so that a decode step reads each tile of the pool once, not once per query
head of its group, and a decode row's one query per head fills a query tile with its
group instead of padding. Each call has

- a block mask that lists, for every row, KV head and query tile, exactly the pool
  tiles it needs (its own blocks up to its last query's position, of that KV head, and
  under a sliding window none before its first query's window), so the kernel reads
  nothing else: decode rows visit their own blocks only, a prefill chunk's early query
  tiles skip the blocks after them; blocks that every query of a tile sees whole are
  "full" (no mask evaluated);
- a mask function that says, for one (row, KV head, folded query, key), whether the key
  is visible: it belongs to the row (``tables[row, logical] == block``, with ``logical``
  the block's position in its row's table, ``block_logical[block]``), to the KV head,
  lies at or before the query's position (causal) and inside the sliding window.
  FlexAttention requires the mask function to be exact on its own (its eager path and
  the partial tiles use it; the block mask only skips work).

Each sliding window the model's layers use gets calls of its own (a step prepares one set
per window; the load's probe, one token through every layer, finds the windows: a layer
asking for a window not prepared yet is handed to the torch path, once).

A physical block has one logical position in every row that holds it: a block is shared
only through the prefix cache, whose keys chain over every earlier block, so a cached
block is always at the same position. ``prepare`` checks this for every step and hands
the step to the torch path if it ever fails to hold.

Rows are split into two calls per layer: short queries (decodes, speculative drafts; the
batched rows of the plan) and prefill chunks, so that a decode batch is not padded to a
chunk's length. Queries past a row's length are padding: their query tiles list no
blocks, and their outputs are dropped.

On CUDA the call is compiled (Triton, ``torch.compile(flex_attention)`` with dynamic
shapes); elsewhere it runs eagerly (exact, but it materializes every score: for tests on
small pools) unless ``compiled=True``. The torch path (``worker/runner/attention.py``: gather + SDPA) is the
reference it is tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from worker.gpu.host_upload import HostUpload

if TYPE_CHECKING:
    from worker.runner.attention_plan import AttentionPlan

#: Folded queries (positions x query heads of one KV head) per query tile of a prefill
#: chunk's block mask.
PREFILL_QUERY_TILE = 64
#: Folded queries per query tile of the short rows (a decode's query heads of one KV
#: head fill one tile, up to 16 of them). Rows of up to this many tokens are short.
SHORT_QUERY_TILE = 16


@dataclass
class FlexCall:
    """One FlexAttention call of a step: some of its rows as a batch."""

    index: torch.Tensor  # [B, L] packed index of each query (padding points at 0)
    scatter: torch.Tensor  # [B * L] where each output goes: its packed index, T for padding
    block_mask: Any  # torch.nn.attention.flex_attention.BlockMask
    mask_inputs: tuple[torch.Tensor, ...]  # what the mask function reads besides block_logical
    window: int | None = None  # the sliding window of the layers this call serves (None: none)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the call reads, in a fixed order (a CUDA graph refills them)."""
        m = self.block_mask
        return [self.index, self.scatter, m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices,
                *self.mask_inputs]


@dataclass
class FlexStep:
    calls: list[FlexCall]


class FlexPagedAttention:
    """The attention plan's ``kernel`` on devices without a compiled paged kernel of their
    own: attention for every row of a step through FlexAttention."""

    def __init__(self, num_heads: int, num_kv_heads: int, compiled: bool | None = None) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.compiled = compiled
        self._eager = flex_attention
        #: logical position of each pool block in the rows that hold it (valid for the
        #: blocks of the current step's rows), on the pool's device
        self._block_logical: torch.Tensor | None = None
        self._logical_upload: HostUpload | None = None
        #: layer calls handed to the torch path (a declined step, a window not prepared
        #: for): a CUDA graph cannot replay them (their plan is built on the host per step)
        self.declined = 0
        #: the sliding windows (None: no window) the layers have asked for, those a step
        #: prepares calls for (none asked yet: window-less calls). A layer that asks for
        #: another is handed to the torch path once (the load's probe meets every layer)
        #: and its window is prepared from the next step on
        self.windows: set[int | None] = set()

    def _flex(self, device: torch.device) -> Any:
        compiled = self.compiled if self.compiled is not None else device.type == "cuda"
        if not compiled:
            return self._eager
        # Dynamic shapes on CUDA (a step's rows, query length and table width vary: one
        # compile serves them); static elsewhere (inductor's CPU template for flex
        # attention fails to build with symbolic sizes in torch 2.13).
        return _compiled_flex(device.type == "cuda")

    # -- per step -----------------------------------------------------------------

    def prepare(self, plan: AttentionPlan, block_table: np.ndarray, rows: np.ndarray, num_computed: np.ndarray,
                num_tokens: np.ndarray, static: bool = False) -> FlexStep | None:
        """The step's calls and block masks (shared by every layer); None when a block
        sits at two positions, or on CUDA when the block size is not a power of two of
        16 or more (then the torch path serves the step). ``static``: index
        lists as wide as the block table (the same shapes whatever the rows' lengths, as
        a CUDA graph needs)."""
        cache = plan.cache
        device = plan.device  # what the kernel runs on (its tensors may be built on the host)
        bs = cache.block_size
        if device.type == "cuda" and (bs < 16 or bs & (bs - 1)):
            return None  # Triton's key tiles are the blocks: a power of two, 16 or more
        pool_blocks = cache.keys[0].shape[0]
        kv_len = num_computed + num_tokens
        nblocks = -(-kv_len // bs)
        width = block_table.shape[1] if static else int(nblocks.max())
        tables = block_table[rows, :width].astype(np.int64)
        held = np.arange(width)[None, :] < nblocks[:, None]
        blocks, logical = tables[held], np.broadcast_to(np.arange(width), tables.shape)[held]
        _, which_block = np.unique(blocks, return_inverse=True)
        position = np.empty(which_block.max(initial=-1) + 1, dtype=np.int64)
        position[which_block] = logical
        if not np.array_equal(position[which_block], logical):
            return None  # a block at two positions
        self._set_block_logical(pool_blocks, blocks, logical, device)
        short = num_tokens <= SHORT_QUERY_TILE
        calls = []
        for window in sorted(self.windows or {None}, key=lambda w: -1 if w is None else w):
            for which, tile in ((short, SHORT_QUERY_TILE), (~short, PREFILL_QUERY_TILE)):
                if which.any():
                    calls.append(self._call(plan, which, tile, tables, num_computed, num_tokens, device, window))
        return FlexStep(calls)

    def _set_block_logical(self, pool_blocks: int, blocks: np.ndarray, logical: np.ndarray,
                           device: torch.device) -> None:
        """Records the step's blocks' logical positions in ``_block_logical`` (on
        ``device``, what the mask function reads): written on the host, then the span
        of the table from the step's lowest block to its highest sent in one
        asynchronous copy from pinned memory on CUDA, rather than indexed on the device
        after two synchronous uploads."""
        if self._block_logical is None or self._block_logical.shape[0] != pool_blocks:
            self._block_logical = torch.full((pool_blocks,), -1, dtype=torch.int32, device=device)
            self._logical_upload = HostUpload(self._block_logical)
        if len(blocks) == 0:
            return
        upload = self._logical_upload
        upload.host_array()[blocks] = logical
        upload.send(slice(int(blocks.min()), int(blocks.max()) + 1))

    def _call(self, plan: AttentionPlan, which: np.ndarray, q_tile: int, tables: np.ndarray,
              num_computed: np.ndarray, num_tokens: np.ndarray, device: torch.device,
              window: int | None = None) -> FlexCall:
        from torch.nn.attention.flex_attention import BlockMask

        cache = plan.cache
        bs, kv_heads, group = cache.block_size, self.num_kv_heads, self.group
        starts = plan.starts[which]
        q_start = num_computed[which]  # position of each row's first query
        q_len = num_tokens[which]
        folded = q_len * group  # queries per (row, KV head): its query heads folded in
        table = tables[which]
        b, longest = len(q_len), int(q_len.max())
        q_tile = min(q_tile, _tile_for(longest * group))
        tiles = -(-longest * group // q_tile)
        # Per (row, query tile), in logical blocks of the row: those any query of the
        # tile sees, [need_lo, needed), and among them those every query sees whole,
        # [full_lo, full_hi) (no mask evaluated there); without a window both start at 0.
        first_q = np.arange(tiles)[None, :] * q_tile  # [1, tiles], folded
        live = first_q < folded[:, None]
        p0 = q_start[:, None] + first_q // group  # the tile's first query position
        p1 = q_start[:, None] + (np.minimum(first_q + q_tile, folded[:, None]) - 1) // group  # its last
        needed = np.where(live, p1 // bs + 1, 0)
        full_hi = np.where(live, (p0 + 1) // bs, 0)
        if window is None:
            need_lo = full_lo = np.zeros_like(needed)
        else:  # key j is seen by query p when p - window < j <= p
            need_lo = np.where(live, np.maximum((p0 - window + 1) // bs, 0), 0)
            full_lo = np.where(live, np.maximum(-(-(p1 - window + 1) // bs), 0), 0)
        full = np.maximum(full_hi - full_lo, 0)
        # The partial blocks: [need_lo, full_lo) then [full_hi, needed) (all of
        # [need_lo, needed) when no block is full).
        split = np.where(full > 0, full_lo, needed)
        resume = np.where(full > 0, full_hi, needed)
        first_n = split - need_lo
        width = table.shape[1]
        k = np.arange(width)[None, None, :]
        partial_logical = np.where(k < first_n[..., None], need_lo[..., None] + k, resume[..., None] + k - first_n[..., None])
        pool_tiles = cache.keys[0].shape[0] * kv_heads
        # Tile ids per KV head: block * kv_heads + head.
        head_kv = np.arange(kv_heads)[None, :, None, None]
        gather = lambda logical: np.take_along_axis(table, np.minimum(logical, width - 1).reshape(b, -1), axis=1
                                                    ).reshape(b, 1, tiles, width)
        partial = gather(partial_logical) * kv_heads + head_kv
        full_ids = (table[:, None, None, :] if window is None else gather(full_lo[..., None] + k)) * kv_heads + head_kv
        kv_num = np.broadcast_to((first_n + needed - resume)[:, None, :], (b, kv_heads, tiles))
        full_num = np.broadcast_to(full[:, None, :], (b, kv_heads, tiles))
        full_ids = np.broadcast_to(full_ids, (b, kv_heads, tiles, width))
        if device.type != "cuda":
            # CPU kernels (eager and compiled) read the index lists as wide as the key
            # sequence's tiles: pad with tiles never listed.
            pad = pool_tiles - width
            partial = np.concatenate([partial, np.zeros((b, kv_heads, tiles, pad), np.int64)], axis=-1)
            full_ids = np.concatenate([full_ids, np.zeros((b, kv_heads, tiles, pad), np.int64)], axis=-1)
        built = plan.token_positions.device  # the host, for a plan a CUDA graph copies in
        as_int = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(built)
        mask_inputs = (as_int(table), as_int(q_start), as_int(folded))
        mask_mod = self._mask_mod(*mask_inputs, bs, window)
        block_mask = BlockMask.from_kv_blocks(
            as_int(kv_num), as_int(partial), as_int(full_num), as_int(full_ids), BLOCK_SIZE=(q_tile, bs),
            mask_mod=mask_mod, seq_lengths=(longest * group, pool_tiles * bs), compute_q_blocks=False,
        )
        qi = np.arange(longest)
        valid = qi[None, :] < q_len[:, None]
        index = np.where(valid, starts[:, None] + qi[None, :], 0)
        scatter = np.where(valid, index, len(plan.host_token_rows)).reshape(-1)
        return FlexCall(index=torch.from_numpy(index).to(built), scatter=torch.from_numpy(scatter).to(built),
                        block_mask=block_mask, mask_inputs=mask_inputs, window=window)

    def _mask_mod(self, table: torch.Tensor, q_start: torch.Tensor, folded: torch.Tensor, bs: int,
                  window: int | None):
        block_logical = self._block_logical
        kv_heads, group = self.num_kv_heads, self.group

        def mask_mod(b, h, q_idx, kv_idx):
            tile = kv_idx // bs
            block = tile // kv_heads
            logical = block_logical[block]
            member = (logical >= 0) & (table[b, logical.clamp(0, table.shape[1] - 1)] == block)
            pos = logical * bs + kv_idx % bs
            q_pos = q_start[b] + q_idx // group
            seen = member & (tile % kv_heads == h) & (q_idx < folded[b]) & (pos <= q_pos)
            return seen if window is None else seen & (pos > q_pos - window)

        return mask_mod

    # -- per layer ----------------------------------------------------------------

    def attend(self, q_all: torch.Tensor, plan: AttentionPlan, layer: int, scale: float, window: int | None,
               softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        step: FlexStep | None = plan.kernel_state
        self.windows.add(window)  # prepared from the next step on, if it was not
        calls = [call for call in step.calls if call.window == window] if step is not None else []
        if not calls:  # a declined step, or a window this step has no calls for: the torch path
            self.declined += 1
            return None
        k_pool, v_pool = plan.cache.keys[layer], plan.cache.values[layer]
        dim = q_all.shape[-1]
        k = k_pool.view(1, 1, -1, dim)
        v = v_pool.view(1, 1, -1, dim)
        flex = self._flex(q_all.device)
        score_mod = _softcap(softcap) if softcap else None
        cuda = q_all.device.type == "cuda"
        total = q_all.shape[0]
        out = q_all.new_empty(total + 1, *q_all.shape[1:])  # row ``total``: where padding lands
        kv_heads, group = self.num_kv_heads, self.group
        for call in calls:
            b, length = call.index.shape
            # [B, L, heads, dim] -> [B, kv_heads, L x group, dim]: a KV head's query heads folded in
            q = (q_all[call.index].view(b, length, kv_heads, group, dim).permute(0, 2, 1, 3, 4)
                 .reshape(b, kv_heads, length * group, dim).to(k.dtype))
            # On CUDA the kernel's tiles are the block mask's (its tiles must divide them),
            # and the general kernel serves short queries too (a block mask of pool tiles).
            options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": call.block_mask.BLOCK_SIZE[0],
                       "BLOCK_N": call.block_mask.BLOCK_SIZE[1]} if cuda else None
            o = flex(q, k, v, score_mod=score_mod, block_mask=call.block_mask, scale=scale, enable_gqa=True,
                     kernel_options=options, **_lse_request(sinks))
            if sinks is not None:
                # A sink adds exp(sink) to the softmax's sum: the output shrinks by
                # sum / (sum + exp(sink)) = sigmoid(lse - sink). Folded query i is head i % group.
                o, lse = o[0], o[1].lse
                sink = sinks.float().view(1, kv_heads, 1, group).expand(1, kv_heads, length, group)
                o = o * torch.sigmoid(lse - sink.reshape(1, kv_heads, length * group)).unsqueeze(-1).to(o.dtype)
            o = o.view(b, kv_heads, length, group, dim).permute(0, 2, 1, 3, 4).reshape(b * length, *q_all.shape[1:])
            out.index_copy_(0, call.scatter, o.to(out.dtype))
        return out[:total]


@functools.cache
def _compiled_flex(dynamic: bool) -> Any:
    """One compiled FlexAttention per process (and shape policy), whatever the runner."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=dynamic)


def _lse_request(sinks: torch.Tensor | None) -> dict[str, Any]:
    """FlexAttention's arguments asking for the log-sum-exp when there are sinks."""
    if sinks is None:
        return {}
    from torch.nn.attention.flex_attention import AuxRequest

    return {"return_aux": AuxRequest(lse=True)}


def _softcap(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


def _tile_for(queries: int) -> int:
    """The smallest power of two >= ``queries`` and >= 16: Triton's tiles are powers of
    two, and its matrix units want 16 rows at least."""
    return max(16, 1 << (max(queries, 1) - 1).bit_length())
