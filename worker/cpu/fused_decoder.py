"""The CPU decoder path for Llama-shaped models: the same layers as the transformers
model, run with a handful of fused ops per layer.

transformers' eager forward dispatches ~30 ops per layer from Python (norms written out
as pow / mean / rsqrt / mul, rotary as slices, cat and muls, the residual adds, views
and transposes); at batch 1 their dispatch is a large share of a small model's decode
step, on top of the time the matmuls need to read the weights. Here a layer is nine
calls (ten where the projections are not merged), the residual stream ``h`` updated in
place:

    x = rms_norm(d, residual=h)                (layer_ops.cpp: h += d, the previous
                                                layer's MLP output, then x = norm(h))
    q, k, v = linears of x                     (prepacked oneDNN weights; one merged
                                                matmul split three ways where the
                                                model's projections were merged)
    rotary_to_cache(q, k, v, ...)              (layer_ops.cpp: rotates q in place, k and
                                                v straight into the paged pool)
    a = attend_cached(q)                       (worker/runner/attention.py: the paged
                                                kernel, worker/cpu/paged_attention.py,
                                                where it applies, else gather + SDPA)
    x = rms_norm(o_proj(a), residual=h)
    g, u = gate_proj(x), up_proj(x)            (likewise one matmul where merged)
    silu_mul(s, g, u)                          (layer_ops.cpp: s = silu(g) * u)
    d = down_proj(s)

(oneDNN can fuse SiLU, the product and the adds into the matmuls as post-ops; those ran
slower than separate passes here.)

It applies where the model is one of the families whose layers are exactly that
(``FAMILIES``: Llama, Mistral, Qwen2, with or without projection biases, any rotary
scaling transformers implements, sliding windows), on CPU, float32 or bfloat16, with
the CPU kernels built; anywhere else the transformers forward runs (it stays the
reference: ``tests/test_fused_decoder.py`` checks this path's logits and greedy tokens
against it, and ``cpu_fused_decoder=False`` turns this path off).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.cpu.packed_linear import LinearSlice, PackedLinear, PanelLinear, merge_linears, merged_parts
from worker.cpu.quant_linear import QuantPanelLinear
from worker.quant.linear import QuantizedLinear
from worker.runner.attention import attend_cached

if TYPE_CHECKING:
    from worker.parallel.group import ParallelGroup
    from worker.runner.attention_plan import AttentionPlan

logger = logging.getLogger("raydecode")

#: model_type -> the causal-LM class whose decoder layers this path reproduces.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    if isinstance(layer, (PanelLinear, QuantPanelLinear)):
        return layer.matmul(x if x.is_contiguous() else x.contiguous())
    if isinstance(layer, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    if isinstance(layer, QuantizedLinear):
        return layer(x)
    return F.linear(x, layer.weight, layer.bias)


def projections(x: torch.Tensor, linears: tuple[nn.Module, ...], sizes: list[int] | None) -> tuple[torch.Tensor, ...]:
    """The outputs of projections that read ``x``: one merged matmul split into column
    views (``sizes``), or each linear in turn."""
    if sizes is not None:
        return linear(x, linears[0]).split(sizes, dim=-1)
    return tuple(linear(x, m) for m in linears)


def projection_group(parts: list[nn.Module]) -> tuple[tuple[nn.Module, ...], list[int] | None]:
    """What ``projections`` runs for ``parts``: their merged linear and sizes when they
    are its slices, else the parts themselves."""
    merged = merged_parts(parts)
    if merged is not None:
        return (merged[0],), merged[1]
    return tuple(parts), None


def merge_projections(model: nn.Module) -> int:
    """Merges each layer's q, k, v and its gate, up projections into one linear each
    (``worker.cpu.packed_linear.merge_linears``); the number of groups merged. Run before
    the linears are packed."""
    merged = 0
    for layer in model.model.layers:
        merged += merge_linears(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        merged += merge_linears(layer.mlp, ("gate_proj", "up_proj"))
    return merged


@dataclass
class FusedLayer:
    input_norm: torch.Tensor  # [hidden]
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: tuple[nn.Module, ...]  # the merged q/k/v linear, or q, k and v
    qkv_sizes: list[int] | None  # its split when merged
    o_proj: nn.Module
    gate_up: tuple[nn.Module, ...]
    gate_up_sizes: list[int] | None
    down_proj: nn.Module
    scaling: float
    sliding_window: int | None


class FusedDecoder:
    """Runs ``model``'s decoder stack and LM head for one step's packed tokens."""

    def __init__(self, model: nn.Module, ops: Any, group: ParallelGroup | None = None) -> None:
        """``group``: the model is one rank's shard (``worker/parallel/sharded_loader.py``):
        the row-parallel projections' partial sums are all-reduced, the LM head's
        vocabulary slices gathered, and a stage that is not the last returns its hidden
        states instead of logits."""
        self.ops = ops
        self.group = group
        self.last_stage = group is None or group.layout.last_stage
        self.vocab_size = int(model.config.vocab_size)
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        if self.last_stage:
            self.final_norm = inner.norm.weight.detach()
            self.final_eps = float(inner.norm.variance_epsilon)
        self.lm_head = model.lm_head
        self.layers = [self._layer(layer, model.config) for layer in inner.layers]

    @staticmethod
    def _layer(layer: nn.Module, config: Any) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_sizes = projection_group([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_sizes = projection_group([mlp.gate_proj, mlp.up_proj])
        return FusedLayer(
            input_norm=layer.input_layernorm.weight.detach(),
            input_eps=float(layer.input_layernorm.variance_epsilon),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            post_eps=float(layer.post_attention_layernorm.variance_epsilon),
            qkv=qkv, qkv_sizes=qkv_sizes, o_proj=attn.o_proj,
            gate_up=gate_up, gate_up_sizes=gate_up_sizes, down_proj=mlp.down_proj,
            scaling=float(attn.scaling),
            sliding_window=_sliding_window(attn, config),
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of ``x``; with ``residual``: ``residual += x`` (in place) first, and
        the norm of the sum."""
        out = torch.empty_like(x)
        self.ops.rms_norm(out, x, residual, weight, eps)
        return out

    def mlp(self, x: torch.Tensor, layer: FusedLayer) -> torch.Tensor:
        gate, up = projections(x, layer.gate_up, layer.gate_up_sizes)
        act = gate if gate.is_contiguous() else torch.empty(gate.shape, dtype=gate.dtype)
        self.ops.silu_mul(act, gate, up)
        return linear(act, layer.down_proj)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the tensor ranks of a row-parallel projection's output."""
        return x if self.group is None else self.group.all_reduce(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: AttentionPlan,
                logits_rows: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """``input_ids``, ``position_ids`` ``[T]``; the logits ``[len(logits_rows),
        vocab]`` of the packed positions ``logits_rows``. A pipeline stage after the
        first passes the previous stage's ``hidden`` states ``[T, hidden]``; one before
        the last returns its own; in a tensor-parallel stage only tensor rank 0 gets
        the logits (the others None)."""
        # [T, hidden]: the residual stream, updated in place
        h = self.embed_tokens(input_ids) if hidden is None else hidden
        cos, sin = self.rotary_emb(h, position_ids.unsqueeze(0))
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        tokens = h.shape[0]
        cache = plan.cache
        head_dim = cache.keys[0].shape[-1]
        out = None  # the previous layer's MLP output, still to be added into h
        for index, layer in enumerate(self.layers):
            if out is None:
                x = self.rms_norm(h, layer.input_norm, layer.input_eps)
            else:
                x = self.rms_norm(out, layer.input_norm, layer.input_eps, residual=h)
            q, k, v = projections(x, layer.qkv, layer.qkv_sizes)
            self.ops.rotary_to_cache(q, k, v, cos, sin, cache.keys[index], cache.values[index], plan.slot_rows)
            a = attend_cached(q.view(tokens, -1, head_dim), plan, index, layer.scaling, layer.sliding_window, None)
            attn_out = self.reduce(linear(a.reshape(tokens, -1), layer.o_proj))
            x = self.rms_norm(attn_out, layer.post_norm, layer.post_eps, residual=h)
            out = self.reduce(self.mlp(x, layer))
        h.add_(out)
        if not self.last_stage:
            return h
        last = self.rms_norm(h.index_select(0, logits_rows), self.final_norm, self.final_eps)
        logits = linear(last, self.lm_head)
        return logits if self.group is None else self.group.gather_logits(logits, self.vocab_size)


def _sliding_window(attn: nn.Module, config: Any) -> int | None:
    """The window the transformers layer passes to its attention call: Qwen2 keeps it
    per layer, Mistral reads the config's, Llama has none."""
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window
    else:
        window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
    return int(window) if window else None


def fused_decoder_applies(model: nn.Module, ops: Any | None) -> bool:
    """Whether this path reproduces ``model`` (with the CPU kernels ``ops``); the
    reason it does not is logged."""
    reason = _why_not(model, ops)
    if reason is not None:
        logger.info("the fused CPU decoder does not apply: %s; the transformers forward runs", reason)
    return reason is None


def _why_not(model: nn.Module, ops: Any | None) -> str | None:
    if ops is None or not hasattr(ops, "rotary_to_cache"):
        return "the CPU kernels are not built"
    config = model.config
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None or type(model).__name__ != family:
        return f"{type(model).__name__} ({getattr(config, 'model_type', None)}) is not one of {sorted(FAMILIES.values())}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
        return f"{param.device.type} {param.dtype} (CPU float32 or bfloat16 only)"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "norm", "layers")
    if inner is None or any(not hasattr(inner, name) for name in needed):
        return "the model lacks the Llama layout (model.embed_tokens, rotary_emb, norm, layers)"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        linear_kinds = (nn.Linear, PackedLinear, PanelLinear, LinearSlice, QuantizedLinear, QuantPanelLinear)
        if any(not isinstance(p, linear_kinds) for p in projections):
            return "a layer's projections are not plain linear layers"
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if any(not hasattr(n, "variance_epsilon") or not hasattr(n, "weight") for n in norms):
            return "a layer's norms are not RMSNorm"
        extra = {name for name, _ in layer.named_children()} - {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
        if extra or {name for name, _ in attn.named_children()} - {"q_proj", "k_proj", "v_proj", "o_proj"}:
            return f"a layer has modules this path does not run ({sorted(extra) or 'in self_attn'})"
    head_dim = getattr(inner.layers[0].self_attn, "head_dim", None)
    probe = torch.zeros(1, 1, dtype=param.dtype)
    cos, _ = inner.rotary_emb(probe, torch.zeros(1, 1, dtype=torch.long))
    if cos.shape[-1] != head_dim:
        return f"partial rotary ({cos.shape[-1]} of {head_dim} dimensions)"
    return None
