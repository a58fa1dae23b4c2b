"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over the paged pool, storing the
compressed latent.

transformers' MLA modules expand the cached latent into full per-head keys and values
before they call the attention interface. Here the module's forward is replaced: the
pool stores, per token, what MLA caches (the normalised KV latent ``c`` of
``kv_lora_rank`` values and the shared rotary key ``k_r`` of ``qk_rope_head_dim``) as
one KV head, and attention runs in the latent space with the up-projection absorbed:

- ``kv_b_proj`` splits per head into ``W_uk`` ``[nope, rank]`` and ``W_uv`` ``[v, rank]``;
- a query head's non-rotary part becomes ``q_c = q_nope @ W_uk`` (``[rank]``), so its
  score against a token is ``q_c . c + q_r . k_r``: the dot product of ``[q_c, q_r]``
  with the stored ``[c, k_r]``, every head against the one stored head (grouped-query
  attention with one KV head and a head size of ``rank + rope``);
- the softmax-weighted sum of the stored rows, cut to its first ``rank`` values, is the
  head's latent output; ``@ W_uv^T`` gives its value-space output for ``o_proj``.

So the paged attention (the torch path, the CPU kernel and FlexAttention alike) serves
it unchanged, with the values pool the keys pool itself: a block holds the latent and
the rotary key and nothing else. The values' weighted sum also runs over the
``rope`` rotary columns, which are dropped (``rope / (rank + rope)`` more work on the
value side, 1/9 at DeepSeek-V3's 512 + 64).

``install_latent_attention`` swaps the forward of the MLA modules whose form it
reproduces (``SUPPORTED``: DeepSeek-V3's, which its copies share); an MLA module of
another form is refused, naming its class.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

from worker.runner.attention import UnsupportedAttention, _active, attend_cached

#: MLA attention classes whose forward ``latent_forward`` reproduces (DeepSeek-V3's form:
#: an optional q LoRA, ``kv_a_proj_with_mqa`` -> latent + rotary key, cos/sin rotary
#: embeddings, plain or interleaved as the config says)
SUPPORTED = {"DeepseekV3Attention", "Glm4MoeLiteAttention", "YoutuAttention", "DeepseekV2Attention", "AXK1Attention",
             "MiniCPM3Attention"}


def is_latent_attention(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_lora_rank"))


def install_latent_attention(model: nn.Module) -> int:
    """Replaces the forward of every MLA module in ``model`` with ``latent_forward``
    (before a backend packs the weights: it reads ``kv_b_proj`` once); the count.
    ``UnsupportedAttention`` for an MLA module of another form."""
    count = 0
    for module in model.modules():
        if not is_latent_attention(module):
            continue
        name = type(module).__name__
        if name.startswith("Latent") and name[len("Latent"):] in SUPPORTED:
            continue  # installed already
        if name not in SUPPORTED:
            raise UnsupportedAttention(
                f"the model uses multi-head latent attention in a form ({name}) the paged attention does not "
                f"implement (it runs {', '.join(sorted(SUPPORTED))})")
        _absorb(module)
        module.__class__ = _latent_class(type(module))
        count += 1
    return count


@functools.cache
def _latent_class(cls: type) -> type:
    """``cls`` with ``latent_forward`` as its forward (a class, not a bound method on
    the instance: a self draft deep-copies the model)."""
    return type(f"Latent{cls.__name__}", (cls,), {"forward": latent_forward, "__module__": cls.__module__})


@torch.no_grad()
def _absorb(module: nn.Module) -> None:
    """``W_uk`` ``[heads, nope, rank]`` and ``W_uv`` ``[heads, v, rank]`` out of
    ``kv_b_proj``, read by applying it to the identity (so a quantized or packed layer
    gives its weights too); the layer itself is no longer called."""
    rank, heads = module.kv_lora_rank, module.num_heads
    nope, v = module.qk_nope_head_dim, module.v_head_dim
    param = next(module.kv_a_proj_with_mqa.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    proj = module.kv_b_proj
    eye = torch.eye(rank, dtype=dtype, device=device)
    bias = getattr(proj, "bias", None)
    w = proj(eye) - (bias if bias is not None else 0)  # [rank, heads * (nope + v)]
    if bias is not None and bool(bias.abs().max() > 0):
        raise UnsupportedAttention("the model's MLA kv_b_proj has a bias, which the latent attention does not absorb")
    w = w.t().reshape(heads, nope + v, rank)
    module.register_buffer("latent_w_uk", w[:, :nope].contiguous(), persistent=False)
    module.register_buffer("latent_w_uv", w[:, nope:].contiguous(), persistent=False)
    module.kv_b_proj = nn.Identity()  # absorbed: its weights live on in the two buffers


def _rotate(module: nn.Module, q: torch.Tensor, k: torch.Tensor, position_embeddings: Any
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding as the module's own modeling code applies it: cos/sin
    (plain, or interleaved when the config says), or DeepSeek-V2's complex form."""
    code = sys.modules[type(module).__module__]
    if not isinstance(position_embeddings, tuple):  # DeepSeek-V2: complex frequencies
        return code.apply_rotary_emb(q, k, position_embeddings.to(q.device))
    cos, sin = position_embeddings
    if getattr(module.config, "rope_interleave", False):
        return code.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    return code.apply_rotary_pos_emb(q, k, cos, sin)


def latent_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: Any = None,
                   attention_mask: torch.Tensor | None = None, cache: Any = None, attention_plan: Any = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The MLA module's forward over one step's packed tokens (``hidden_states``
    ``[1, T, hidden]``), against the paged pool in the latent space."""
    plan = attention_plan if attention_plan is not None else getattr(_active, "plan", None)
    if plan is None:
        raise RuntimeError("the latent attention needs the step's attention_plan")
    layer = self.layer_idx
    if plan.seen_layers is not None:
        plan.seen_layers.add(layer)
    batch, tokens = hidden_states.shape[:2]
    heads, nope, rope, rank = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(batch, tokens, heads, nope + rope).transpose(1, 2)  # [1, heads, T, nope + rope]
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    latent = self.kv_a_layernorm(latent)
    k_rot = k_rot.view(batch, 1, tokens, rope)
    q_rot, k_rot = _rotate(self, q_rot, k_rot, position_embeddings)

    # The stored row: [latent, rotary key], one KV head (the values pool is the keys pool).
    k_pool = plan.cache.keys[layer]
    stored = torch.cat([latent[0], k_rot[0, 0]], dim=-1).to(k_pool.dtype)  # [T, rank + rope]
    k_pool.view(-1, rank + rope).index_copy_(0, plan.slot_rows, stored)
    w_uk, w_uv = self.latent_w_uk, self.latent_w_uv
    q_latent = torch.matmul(q_nope[0], w_uk.to(q_nope.dtype))  # [heads, T, rank]
    query = torch.cat([q_latent, q_rot[0]], dim=-1).transpose(0, 1)  # [T, heads, rank + rope]
    out = attend_cached(query.contiguous(), plan, layer, self.scaling, None, None)[..., :rank]
    out = torch.matmul(out.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2))  # [heads, T, v]
    out = out.transpose(0, 1).reshape(batch, tokens, heads * self.v_head_dim).to(hidden_states.dtype)
    return self.o_proj(out), None
