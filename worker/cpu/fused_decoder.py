"""The CPU decoder path for the Llama, Qwen, Phi-3, Gemma, Mixtral and gpt-oss families:
the same layers as the transformers model, run with a handful of fused ops per layer.

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

That is a Llama layer; the other families fill in more parts of the same description
(``LayerParts``: per-head q/k norms, sandwich norms, Gemma's norms and GELU-tanh, soft
caps, fused checkpoint projections, a rotary per layer type, attention sinks, a
mixture-of-experts block). It applies where the
model is one of ``FAMILIES`` (with or without projection biases, any rotary scaling
transformers implements, sliding windows), on CPU, float32 or bfloat16, with
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
from worker.runner.lora import Parts, StepLoRA

if TYPE_CHECKING:
    from worker.parallel.group import ParallelGroup
    from worker.runner.attention_plan import AttentionPlan

logger = logging.getLogger("raydecode")

#: model_type -> the causal-LM class whose decoder layers this path reproduces: each
#: family's layer is the same sequence of parts (``LayerParts``), some absent or named
#: otherwise (``describe_layer``).
FAMILIES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM",
}
#: families whose rotary embedding returns cos and sin for half the head (each pair of
#: halves rotated by the same angle: gpt-oss); the fused op takes them repeated twice
HALF_ROTARY = {"gpt_oss"}
#: families whose attention reads its sliding window from the config (the others keep
#: it on the attention module, per layer)
WINDOW_FROM_CONFIG = {"mistral", "phi3", "mixtral"}
#: RMSNorms that scale by ``1 + weight`` (Gemma's): the fused op is given ``1 + weight``
OFFSET_NORMS = {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"}
#: the MLP activations this path runs (``config.hidden_activation`` or ``hidden_act``)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    if isinstance(layer, (PanelLinear, QuantPanelLinear)):
        return layer.matmul(x if x.is_contiguous() else x.contiguous())
    if isinstance(layer, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    if isinstance(layer, QuantizedLinear):
        return layer(x)
    return F.linear(x, layer.weight, layer.bias)


def projections(x: torch.Tensor, linears: tuple[nn.Module, ...], sizes: list[int] | None,
                lora: StepLoRA | None = None, parts: Parts = ()) -> tuple[torch.Tensor, ...]:
    """The outputs of projections that read ``x``: one merged matmul split into column
    views (``sizes``), or each linear in turn; with ``lora``, the step's adapter
    products over ``parts`` added (``worker/runner/lora.py``)."""
    outs = (linear(x, linears[0]),) if sizes is not None else tuple(linear(x, m) for m in linears)
    if lora is not None:
        lora.add(parts, x, outs)
    return outs[0].split(sizes, dim=-1) if sizes is not None else outs


def lora_parts(modules: list[nn.Module], sizes: list[int] | None, names: dict[int, str]) -> Parts:
    """The ``Parts`` of projections ``modules`` (by their names in the model) as
    ``projections`` runs them: column runs of one merged output, or one output each."""
    if sizes is None:
        return tuple((names[id(m)], i, 0, int(m.out_features)) for i, m in enumerate(modules))
    if len(modules) == 1:  # fused in the checkpoint (Phi-3): adapters attach to it whole
        return ((names[id(modules[0])], 0, 0, sum(sizes)),)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple((names[id(m)], 0, start, size) for m, start, size in zip(modules, starts, sizes))


def projection_group(parts: list[nn.Module]) -> tuple[tuple[nn.Module, ...], list[int] | None]:
    """What ``projections`` runs for ``parts``: their merged linear and sizes when they
    are its slices, else the parts themselves."""
    merged = merged_parts(parts)
    if merged is not None:
        return (merged[0],), merged[1]
    return tuple(parts), None


def _is_moe(mlp: nn.Module | None) -> bool:
    """A mixture-of-experts block whose experts run packed (``worker/runner/experts.py``)."""
    return mlp is not None and hasattr(getattr(mlp, "experts", None), "expert_up")


def merge_projections(model: nn.Module) -> int:
    """Merges each layer's q, k, v and its gate, up projections into one linear each
    (``worker.cpu.packed_linear.merge_linears``); the number of groups merged (a family
    that ships them fused, Phi-3's ``qkv_proj`` / ``gate_up_proj``, has none to merge).
    Run before the linears are packed."""
    merged = 0
    for layer in model.model.layers:
        merged += merge_linears(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        if not _is_moe(layer.mlp):
            merged += merge_linears(layer.mlp, ("gate_proj", "up_proj"))
    return merged


@dataclass
class Norm:
    """An RMSNorm as the fused op applies it: ``out = weight * x / rms(x)``."""

    weight: torch.Tensor
    eps: float


def norm_of(module: nn.Module | None) -> Norm | None:
    """The RMSNorm ``module`` as a ``Norm`` (Gemma's ``1 + weight`` folded in); None for
    anything else."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return None
    if type(module).__name__ in OFFSET_NORMS and hasattr(module, "eps"):
        return Norm((1.0 + weight.detach().float()).to(weight.dtype), float(module.eps))
    if hasattr(module, "variance_epsilon"):
        return Norm(weight.detach(), float(module.variance_epsilon))
    return None


@dataclass
class LayerParts:
    """One decoder layer as a sequence of parts, the same for every family; a family
    fills in the parts it has (``describe_layer``)::

        x = input_norm(h)                      (h += the previous layer's MLP output first)
        q, k, v = qkv(x)                       (one merged or fused matmul, or three)
        q, k = q_norm(q), k_norm(k)            (per head: Qwen3, Gemma 3)
        rotary on q and k (the rotary of the layer's type), k and v into the pool
        a = o_proj(attention(q))               (window, softcap, scaling, sinks of the layer)
        a = post_attn_norm(a)                  (sandwich norms: Gemma 2, 3)
        x = pre_mlp_norm(h += a)
        m = down_proj(act(gate) * up)          (SiLU, or GELU-tanh: Gemma; or the
                                                family's mixture-of-experts block, its
                                                experts packed: ``worker/runner/experts.py``)
        m = post_mlp_norm(m)                   (sandwich norms)
    """

    input_norm: Norm
    pre_mlp_norm: Norm
    qkv: tuple[nn.Module, ...]  # the merged q/k/v linear, or q, k and v
    qkv_sizes: list[int] | None  # its split when merged
    o_proj: nn.Module
    gate_up: tuple[nn.Module, ...]  # empty with ``moe``
    gate_up_sizes: list[int] | None
    down_proj: nn.Module | None  # None with ``moe``
    scaling: float
    sliding_window: int | None
    softcap: float | None = None
    activation: str = "silu"
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    post_attn_norm: Norm | None = None
    post_mlp_norm: Norm | None = None
    #: the layer type whose rotary embedding the layer takes (None: the model's one)
    rotary: str | None = None
    #: the family's mixture-of-experts block in place of the MLP (its router, its
    #: experts' packed linears, its shared experts); None: a dense MLP
    moe: nn.Module | None = None
    #: the heads' attention sinks (gpt-oss: an extra logit per head in the softmax)
    sinks: torch.Tensor | None = None
    #: where LoRA adapters attach: the ``Parts`` of qkv, o_proj, gate_up and down_proj
    lora: dict[str, Parts] | None = None


#: the old name (tests and tools import it)
FusedLayer = LayerParts


def describe_layer(layer: nn.Module, config: Any) -> LayerParts:
    """A transformers decoder layer of one of ``FAMILIES`` as ``LayerParts``."""
    attn, mlp = layer.self_attn, layer.mlp
    moe = mlp if _is_moe(mlp) else None
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = attn.head_dim
    if hasattr(attn, "qkv_proj"):  # fused in the checkpoint (Phi-3)
        qkv, qkv_sizes = (attn.qkv_proj,), [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    else:
        qkv, qkv_sizes = projection_group([attn.q_proj, attn.k_proj, attn.v_proj])
    if moe is not None:
        gate_up, gate_up_sizes, down = (), None, None
    elif hasattr(mlp, "gate_up_proj"):  # gate rows first, then up (Phi-3)
        width = mlp.gate_up_proj.out_features // 2
        gate_up, gate_up_sizes, down = (mlp.gate_up_proj,), [width, width], mlp.down_proj
    else:
        gate_up, gate_up_sizes = projection_group([mlp.gate_proj, mlp.up_proj])
        down = mlp.down_proj
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    return LayerParts(
        input_norm=norm_of(layer.input_layernorm),
        pre_mlp_norm=norm_of(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
        post_attn_norm=norm_of(layer.post_attention_layernorm) if sandwich else None,
        post_mlp_norm=norm_of(layer.post_feedforward_layernorm) if sandwich else None,
        qkv=qkv, qkv_sizes=qkv_sizes, o_proj=attn.o_proj,
        gate_up=gate_up, gate_up_sizes=gate_up_sizes, down_proj=down, moe=moe,
        scaling=float(attn.scaling),
        sliding_window=_sliding_window(attn, config),
        softcap=getattr(attn, "attn_logit_softcapping", None) or None,
        activation=ACTIVATIONS[_activation(config)],
        q_norm=norm_of(getattr(attn, "q_norm", None)),
        k_norm=norm_of(getattr(attn, "k_norm", None)),
        rotary=getattr(attn, "layer_type", None) if _rotary_per_layer_type(config) else None,
        sinks=attn.sinks.detach() if isinstance(getattr(attn, "sinks", None), torch.Tensor) else None,
    )


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
        config = model.config
        self.vocab_size = int(config.vocab_size)
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        if self.last_stage:
            self.final_norm = norm_of(inner.norm)
        self.final_softcap = getattr(config, "final_logit_softcapping", None) or None
        self.lm_head = model.lm_head
        self.layers = [describe_layer(layer, config) for layer in inner.layers]
        names = {id(m): n for n, m in model.named_modules()}
        for parts, layer in zip(self.layers, inner.layers):
            parts.lora = _layer_lora_parts(layer, parts, names)
        #: with enable_lora, the worker's adapters (``worker/runner/lora.py``): the
        #: step's products are added after each projection while ``lora.active``
        self.lora: Any = None
        self.half_rotary = config.model_type in HALF_ROTARY
        self.rotary_types = sorted({layer.rotary for layer in self.layers if layer.rotary is not None})

    def rms_norm(self, x: torch.Tensor, norm: Norm, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of ``x``; with ``residual``: ``residual += x`` (in place) first, and
        the norm of the sum."""
        out = torch.empty_like(x)
        self.ops.rms_norm(out, x, residual, norm.weight, norm.eps)
        return out

    def head_norm(self, x: torch.Tensor, norm: Norm, tokens: int) -> torch.Tensor:
        """A per-head RMSNorm (Qwen3's, Gemma 3's q/k norms) of ``x`` ``[T, heads *
        head_dim]`` (a column view is copied): ``[T, heads * head_dim]``, contiguous."""
        dim = norm.weight.shape[0]
        # (one head of a column view reshapes to a view with the view's row stride)
        return self.rms_norm(x.reshape(-1, dim).contiguous(), norm).view(tokens, -1)

    def mlp(self, x: torch.Tensor, layer: LayerParts, lora: StepLoRA | None = None) -> torch.Tensor:
        if layer.moe is not None:
            out = layer.moe(x.unsqueeze(0))
            return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
        gate, up = projections(x, layer.gate_up, layer.gate_up_sizes, lora, layer.lora["gate_up"] if lora else ())
        act = gate if gate.is_contiguous() else torch.empty(gate.shape, dtype=gate.dtype)
        if layer.activation == "silu":
            self.ops.silu_mul(act, gate, up)
        else:
            self.ops.gelu_tanh_mul(act, gate, up)
        return projections(act, (layer.down_proj,), None, lora, layer.lora["down"] if lora else ())[0]

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the tensor ranks of a row-parallel projection's output."""
        return x if self.group is None else self.group.all_reduce(x)

    def rotary(self, h: torch.Tensor, position_ids: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """The step's cos and sin ``[T, rotary dims]``, per layer type where the model's
        rotary embedding depends on it (Gemma 3's local and global bases)."""
        pos = position_ids.unsqueeze(0)
        out = {}
        for kind in self.rotary_types or [None]:
            cos, sin = self.rotary_emb(h, pos) if kind is None else self.rotary_emb(h, pos, kind)
            if self.half_rotary:
                cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            out[kind] = (cos[0].contiguous(), sin[0].contiguous())
        return out

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: AttentionPlan,
                logits_rows: torch.Tensor, hidden: torch.Tensor | None = None, head: bool = True,
                ) -> torch.Tensor | None:
        """``input_ids``, ``position_ids`` ``[T]``; the logits ``[len(logits_rows),
        vocab]`` of the packed positions ``logits_rows`` (``head`` False: their hidden
        states after the final norm, what a pooling model pools). A pipeline stage after
        the first passes the previous stage's ``hidden`` states ``[T, hidden]``; one
        before the last returns its own; in a tensor-parallel stage only tensor rank 0
        gets the logits (the others None)."""
        # [T, hidden]: the residual stream, updated in place
        h = self.embed_tokens(input_ids) if hidden is None else hidden
        rotary = self.rotary(h, position_ids)
        tokens = h.shape[0]
        cache = plan.cache
        head_dim = cache.keys[0].shape[-1]
        out = None  # the previous layer's MLP output, still to be added into h
        lora = self.lora.active if self.lora is not None else None
        for index, layer in enumerate(self.layers):
            x = self.rms_norm(h, layer.input_norm) if out is None else self.rms_norm(out, layer.input_norm, residual=h)
            q, k, v = projections(x, layer.qkv, layer.qkv_sizes, lora, layer.lora["qkv"] if lora else ())
            if layer.q_norm is not None:
                q = self.head_norm(q, layer.q_norm, tokens)
            if layer.k_norm is not None:
                k = self.head_norm(k, layer.k_norm, tokens)
            cos, sin = rotary[layer.rotary]
            self.ops.rotary_to_cache(q, k, v, cos, sin, cache.keys[index], cache.values[index], plan.slot_rows)
            a = attend_cached(q.view(tokens, -1, head_dim), plan, index, layer.scaling, layer.sliding_window,
                              layer.softcap, layer.sinks)
            attn_out = self.reduce(projections(a.reshape(tokens, -1), (layer.o_proj,), None, lora,
                                               layer.lora["o"] if lora else ())[0])
            if layer.post_attn_norm is not None:
                attn_out = self.rms_norm(attn_out, layer.post_attn_norm)
            x = self.rms_norm(attn_out, layer.pre_mlp_norm, residual=h)
            out = self.reduce(self.mlp(x, layer, lora))
            if layer.post_mlp_norm is not None:
                out = self.rms_norm(out, layer.post_mlp_norm)
        h.add_(out)
        if not self.last_stage:
            return h
        last = self.rms_norm(h.index_select(0, logits_rows), self.final_norm)
        if not head:
            return last
        logits = linear(last, self.lm_head)
        if self.group is not None:
            logits = self.group.gather_logits(logits, self.vocab_size)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _layer_lora_parts(layer: nn.Module, parts: LayerParts, names: dict[int, str]) -> dict[str, Parts]:
    """Where adapters attach in ``layer`` (described as ``parts``), by module name."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    out = {"qkv": lora_parts(qkv, parts.qkv_sizes, names), "o": lora_parts([attn.o_proj], None, names),
           "gate_up": (), "down": ()}
    if parts.moe is None:
        gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
        out["gate_up"] = lora_parts(gate_up, parts.gate_up_sizes, names)
        out["down"] = lora_parts([mlp.down_proj], None, names)
    return out


def _sliding_window(attn: nn.Module, config: Any) -> int | None:
    """The window the transformers layer passes to its attention call: Qwen2, Qwen3 and
    Gemma keep it per layer, Mistral and Phi-3 read the config's, Llama has none."""
    if config.model_type in WINDOW_FROM_CONFIG:
        window = getattr(config, "sliding_window", None)
    else:
        window = getattr(attn, "sliding_window", None)
    return int(window) if window else None


def _activation(config: Any) -> str:
    return str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None))


def _rotary_per_layer_type(config: Any) -> bool:
    """Whether the model's rotary embedding takes the layer type (Gemma 3: local layers
    rotate with their own base)."""
    params = getattr(config, "rope_parameters", None)
    types = set(getattr(config, "layer_types", None) or [])
    return bool(types) and isinstance(params, dict) and types <= set(params)


def fused_decoder_applies(model: nn.Module, ops: Any | None) -> bool:
    """Whether this path reproduces ``model`` (with the CPU kernels ``ops``); the
    reason it does not is logged."""
    reason = _why_not(model, ops)
    if reason is not None:
        logger.info("the fused CPU decoder does not apply: %s; the transformers forward runs", reason)
    return reason is None


#: the children a layer, its attention and its MLP may have (dropouts aside: no-ops here)
LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm"}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_norm", "k_norm"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "act_fn", "activation_fn"}


def _why_not(model: nn.Module, ops: Any | None) -> str | None:
    if ops is None or not hasattr(ops, "rotary_to_cache"):
        return "the CPU kernels are not built"
    config = model.config
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None or type(model).__name__ != family:
        return f"{type(model).__name__} ({getattr(config, 'model_type', None)}) is not one of {sorted(FAMILIES.values())}"
    if _activation(config) not in ACTIVATIONS:
        return f"activation {_activation(config)!r} (only {sorted(ACTIVATIONS)})"
    if ACTIVATIONS[_activation(config)] == "gelu_tanh" and not hasattr(ops, "gelu_tanh_mul"):
        return "the CPU kernels predate gelu_tanh_mul"
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
        return f"{param.device.type} {param.dtype} (CPU float32 or bfloat16 only)"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "norm", "layers")
    if inner is None or any(not hasattr(inner, name) for name in needed):
        return "the model lacks the Llama layout (model.embed_tokens, rotary_emb, norm, layers)"
    if not isinstance(inner.norm, nn.Identity) and norm_of(inner.norm) is None:  # (a stage before the last has none)
        return "the final norm is not an RMSNorm"
    linear_kinds = (nn.Linear, PackedLinear, PanelLinear, LinearSlice, QuantizedLinear, QuantPanelLinear)
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts") and not _is_moe(mlp):
            return "its experts are not unstacked into linears (cpu_packed_linear off, or another layout)"
        extra = _children(layer) - LAYER_PARTS
        extra |= {f"self_attn.{n}" for n in _children(attn) - ATTENTION_PARTS}
        if not _is_moe(mlp):  # an MoE block runs as the family's own module
            extra |= {f"mlp.{n}" for n in _children(mlp) - MLP_PARTS}
        if extra:
            return f"a layer has modules this path does not run ({sorted(extra)})"
        names = [("qkv_proj",)] if hasattr(attn, "qkv_proj") else [("q_proj", "k_proj", "v_proj")]
        if not _is_moe(mlp):
            names += [("gate_up_proj",)] if hasattr(mlp, "gate_up_proj") else [("gate_proj", "up_proj")]
            names += [("down_proj",)]
        parts = [getattr(attn, n, None) for n in names[0] + ("o_proj",)]
        parts += [getattr(mlp, n, None) for group in names[1:] for n in group]
        if any(not isinstance(p, linear_kinds) for p in parts):
            return "a layer's projections are not plain linear layers"
        norms = [getattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                              "post_feedforward_layernorm") if hasattr(layer, n)]
        norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if any(norm_of(n) is None for n in norms):
            return "a layer's norms are not RMSNorm"
    head_dim = getattr(inner.layers[0].self_attn, "head_dim", None)
    probe = torch.zeros(1, 1, dtype=param.dtype)
    position = torch.zeros(1, 1, dtype=torch.long)
    kinds = sorted(set(getattr(config, "layer_types", None) or [])) if _rotary_per_layer_type(config) else [None]
    for kind in kinds:
        cos, _ = inner.rotary_emb(probe, position) if kind is None else inner.rotary_emb(probe, position, kind)
        if cos.shape[-1] * (2 if config.model_type in HALF_ROTARY else 1) != head_dim:
            return f"partial rotary ({cos.shape[-1]} of {head_dim} dimensions)"
    return None


def _children(module: nn.Module | None) -> set[str]:
    """``module``'s child names, dropouts left out (they do nothing at inference)."""
    if module is None:
        return set()
    return {name for name, child in module.named_children() if not isinstance(child, nn.Dropout)}
