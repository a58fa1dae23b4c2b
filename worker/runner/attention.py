"""Paged attention: the function transformers' attention interface calls for every
layer, and the torch reference path it falls back to.

The model runs unchanged through transformers' ``AttentionInterface``: each layer's
attention call gets the step's ``AttentionPlan`` (``worker/runner/attention_plan.py``:
the packed tokens' slots and, per row, its block table and lengths) and

1. writes the step's keys and values into their slots of the pool
   (``worker/runner/kv_pool.py``);
2. attends for rows with short queries (decodes, speculative verification) together,
   with the plan's paged kernel (the CPU kernel, ``worker/cpu/``: reads each row's
   blocks in place) when there is one and it applies, else by gathering the rows'
   blocks and one batched ``scaled_dot_product_attention`` (the device-agnostic
   reference path: the same code runs on CUDA);
3. attends for long prefill chunks: with the kernel, every chunk cut into runs of
   ``kernel.prefill_queries`` queries and attended in one kernel call with the step's
   short-query rows (``KernelRows``: each run reads its row's keys up to its own last
   query, so a causal chunk's masked half is mostly never computed; the call reads the
   packed queries and writes the packed outputs in place); elsewhere row by row (gather
   the row's blocks, then SDPA).

Sliding windows (Mistral, Qwen2, Gemma's local layers), logit soft-capping (Gemma 2)
and attention sinks (gpt-oss: a per-head logit that joins each softmax's denominator)
come as the attention call's ``sliding_window`` / ``softcap`` / ``s_aux`` arguments and
are applied on every path. Features the paged path does not implement are refused when the model
loads (``check_attention_features``), never silently ignored.

``register_paged_attention`` adds the function to transformers' registry; the runner
calls it before it loads a model (importing this module registers nothing).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from worker.runner.attention_plan import AttentionPlan

ATTENTION_NAME = "raydecode_paged"

#: Config attributes of attention behaviours the paged path does not implement.
UNSUPPORTED_CONFIG = {
    "attention_chunk_size": "chunked local attention (Llama 4)",
    "use_bidirectional_attention": "bidirectional attention",
    "alibi": "ALiBi position biases",
}
#: Attention-call arguments that change the result and that the paged path does not
#: implement (seen in the load-time probe).
UNSUPPORTED_ARGUMENTS = {
    "position_bias": "additive position biases",
}


class UnsupportedAttention(ValueError):
    """The model needs an attention feature the paged path does not implement."""


_active = threading.local()


@contextmanager
def plan_in_effect(plan: AttentionPlan) -> Iterator[None]:
    """``plan`` is the step's for every attention call made inside: the calls of a
    model whose decoder layers do not pass their keyword arguments on to attention
    (StableLM's) find it here, not in their arguments."""
    saved = getattr(_active, "plan", None)
    _active.plan = plan
    try:
        yield
    finally:
        _active.plan = saved


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [B, kv_heads, G*Q, D]`` against ``k, v [B, kv_heads, L, D]`` under ``mask``
    (broadcastable to ``[B, 1|kv_heads, G*Q, L]``): SDPA, or the written-out math when
    scores are soft-capped (``softcap * tanh(s / softcap)``, Gemma 2) or the heads have
    attention sinks (``sinks`` ``[kv_heads, G*Q]``, each query's head's extra logit: it
    joins the softmax's denominator and attends to nothing, gpt-oss)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    sink = sinks.float().unsqueeze(-1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def sink_logits(sinks: torch.Tensor | None, kv_heads: int, queries: int) -> torch.Tensor | None:
    """A layer's per-head sinks ``[heads]`` laid out as ``attend`` takes them for
    ``queries`` queries per head, heads grouped by their KV head: ``[kv_heads, G*Q]``."""
    if sinks is None:
        return None
    return sinks.view(kv_heads, -1, 1).expand(-1, -1, queries).reshape(kv_heads, -1)


_FROM_CONFIG = object()


def config_window(module: torch.nn.Module, layer: int) -> int | None:
    """The sliding window of a layer whose model applies it through its attention
    mask only (PhiMoE; the paged path has no mask): the config's ``sliding_window``,
    on the layers ``layer_types`` marks sliding when it has them, unless
    ``use_sliding_window`` turns it off."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types and layer < len(types) and types[layer] != "sliding_attention":
        return None
    return int(window)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attention_plan: AttentionPlan | None = None,
    sliding_window: int | None | object = _FROM_CONFIG,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, heads, T, dim]``, ``key``/``value`` ``[1, kv_heads, T, dim]`` for
    the step's packed tokens; returns ``[1, T, heads, dim]``. ``s_aux``: the heads'
    attention sinks (gpt-oss), ``[heads]``."""
    plan = attention_plan if attention_plan is not None else getattr(_active, "plan", None)
    if plan is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the step's attention_plan")
    for name, feature in UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"the model uses {feature} ({name}), which the paged attention does not implement")
    layer = module.layer_idx
    if plan.seen_layers is not None:
        plan.seen_layers.add(layer)
    k_pool, v_pool = plan.cache.keys[layer], plan.cache.values[layer]
    rows = k_pool.shape[0] * k_pool.shape[1] * k_pool.shape[2]
    k_pool.view(rows, -1).index_copy_(0, plan.slot_rows, key[0].transpose(0, 1).reshape(-1, key.shape[-1]).to(k_pool.dtype))
    v_pool.view(rows, -1).index_copy_(0, plan.slot_rows, value[0].transpose(0, 1).reshape(-1, value.shape[-1]).to(v_pool.dtype))
    if sliding_window is _FROM_CONFIG:
        sliding_window = config_window(module, layer)
    window = int(sliding_window) if sliding_window else None
    sinks = s_aux if s_aux is not None else kwargs.get("sinks")
    out = attend_cached(query[0].transpose(0, 1), plan, layer, scaling, window, softcap, sinks)
    return out.unsqueeze(0), None


def attend_cached(
    q_all: torch.Tensor, plan: AttentionPlan, layer: int, scaling: float | None,
    window: int | None, softcap: float | None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for the step's packed queries ``q_all`` ``[T, heads, dim]`` over layer
    ``layer``'s pool, the step's own keys and values already written; ``[T, heads,
    dim]``: the plan's kernel where it applies; else the torch path (short-query rows
    together by gathering their blocks, prefill chunks row by row). ``sinks``: the
    heads' attention sinks ``[heads]`` (None: none)."""
    k_pool, v_pool = plan.cache.keys[layer], plan.cache.values[layer]
    total, heads, dim = q_all.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    if plan.kernel is not None:
        out = plan.kernel.attend(q_all, plan, layer, scale, window, softcap, sinks)
        if out is not None:
            return out
    out = q_all.new_empty(total, heads, dim)

    if plan.num_batched:
        b, q_len = plan.num_batched, plan.batched_query_len
        q = q_all[plan.batched_index].view(b * q_len, heads, dim)
        o = _batched_by_gathering(q, k_pool, v_pool, plan, scale, softcap, window, sinks)
        out[plan.batched_index.reshape(-1)[plan.batched_valid]] = o[plan.batched_valid].to(out.dtype)

    for chunk in plan.prefill:
        s, n = chunk.start, chunk.num_tokens
        q = q_all[s : s + n].transpose(0, 1).reshape(kv_heads, group * n, dim).unsqueeze(0)
        k = gather_blocks(k_pool, chunk.block_ids)[:, : chunk.kv_len].unsqueeze(0)
        v = gather_blocks(v_pool, chunk.block_ids)[:, : chunk.kv_len].unsqueeze(0)
        q_pos = torch.arange(chunk.kv_len - n, chunk.kv_len, device=q.device).repeat(group)
        if window is None and not softcap and sinks is None and chunk.kv_len == n:
            o = F.scaled_dot_product_attention(q.view(1, heads, n, dim), k, v, is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
            out[s : s + n] = o[0].transpose(0, 1).to(out.dtype)
            continue
        o = attend(q.to(k.dtype), k, v, visible(q_pos, chunk.kv_len, window), scale, softcap,
                   sink_logits(sinks, kv_heads, n))
        out[s : s + n] = o.reshape(heads, n, dim).transpose(0, 1).to(out.dtype)
    return out


def _batched_by_gathering(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan,
    scale: float, softcap: float | None, window: int | None, sinks: torch.Tensor | None = None,
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
    o = attend(qq.to(k.dtype), k, v, mask, scale, softcap, sink_logits(sinks, kv_heads, q_len))
    return o.reshape(b, kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(b * q_len, heads, dim)


def check_attention_features(config: object) -> None:
    """Refuses, naming the feature, a model config that asks for an attention
    behaviour the paged path does not implement."""
    configs = [config] + [getattr(config, name) for name in ("text_config",) if getattr(config, name, None) is not None]
    for cfg in configs:
        for attr, feature in UNSUPPORTED_CONFIG.items():
            if getattr(cfg, attr, None):
                raise UnsupportedAttention(f"the model uses {feature} ({attr}), which the paged attention does not implement")



def register_paged_attention() -> None:
    """Makes ``attn_implementation=ATTENTION_NAME`` mean ``paged_attention`` in
    transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
