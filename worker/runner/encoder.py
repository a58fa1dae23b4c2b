"""Encoder models (BERT, RoBERTa, XLM-RoBERTa) run over one step's packed prompts.

An encoder attends bidirectionally within a prompt, so a prompt runs whole in one step
and keeps no KV cache. The step's prompts are packed into one sequence of tokens, with
their positions restarting at each prompt (and each prompt's token types), and run
through transformers' own encoder layers; only attention is ours: ``packed_attention``,
registered in transformers' attention interface as ``PACKED_ATTENTION``, attends within
each prompt's span of the packed tokens (SDPA per span, or over all spans at once when
they have one length). Nothing is padded, so a step costs its real tokens.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.pooling import ENCODER_TYPES, PoolingModelError, dense_layers, first_position

PACKED_ATTENTION = "raydecode_packed"
#: spans up to this long attend by two matmuls and a softmax (faster than SDPA's CPU
#: kernel on short ones), longer ones through SDPA
MATMUL_ATTENTION_MAX = 128


@dataclass
class PackedSpans:
    """Where each prompt lies in a step's packed tokens."""

    starts: list[int]
    lengths: list[int]
    #: the layers whose attention ran through ``packed_attention`` (the load's probe)
    seen: set[int] | None = None


_spans: ContextVar[PackedSpans | None] = ContextVar("raydecode_packed_spans", default=None)


@contextlib.contextmanager
def spans_in_effect(spans: PackedSpans) -> Iterator[None]:
    token = _spans.set(spans)
    try:
        yield
    finally:
        _spans.reset(token)


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention call over packed prompts: ``query``/``key``/``value``
    ``[1, heads, T, head_dim]`` -> ``[1, T, heads, head_dim]``, each token attending to
    every token of its own prompt only."""
    spans = _spans.get()
    if spans is None:
        raise RuntimeError(f"{PACKED_ATTENTION} attention needs the step's packed spans (spans_in_effect)")
    if spans.seen is not None:
        spans.seen.add(id(module))
    heads, total, dim = query.shape[1], query.shape[2], query.shape[3]
    lengths = spans.lengths
    if len(set(lengths)) == 1:  # one length: every prompt in one call
        n, length = len(lengths), lengths[0]

        def split(x: torch.Tensor) -> torch.Tensor:
            return x[0].view(x.shape[1], n, length, dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(split(query), split(key), split(value), scale=scaling)
        return out.permute(0, 2, 1, 3).reshape(1, total, heads, dim), None
    out = query.new_empty(total, heads, dim)
    scale = scaling if scaling is not None else dim**-0.5
    for start, length in zip(spans.starts, lengths):
        part = slice(start, start + length)
        q, k, v = query[:, :, part], key[:, :, part], value[:, :, part]
        if length <= MATMUL_ATTENTION_MAX:
            o = torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1), v)
        else:
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)
        out[part] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def register_packed_attention() -> None:
    """Makes ``attn_implementation=PACKED_ATTENTION`` mean ``packed_attention`` in
    transformers (idempotent). It needs no mask: transformers builds none for an
    attention function without a mask function of its own."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


class EncoderModel:
    """A loaded encoder: its base model, the task's head, and the packed forward."""

    def __init__(self, model: nn.Module, task: str) -> None:
        self.model = model
        self.config = model.config
        self.task = task
        kind = self.config.model_type
        if kind not in ENCODER_TYPES:
            raise PoolingModelError(f"model_type {kind!r} is not an encoder raydecode serves "
                                    f"(it serves {sorted(ENCODER_TYPES)})")
        self.base = getattr(model, model.base_model_prefix) if task == "classify" else model
        self.first_position = first_position(self.config)
        self.type_vocab_size = int(getattr(self.config, "type_vocab_size", 1) or 1)

    @property
    def layers(self) -> list[nn.Module]:
        """The self-attention module of every layer (what the probe expects to run)."""
        return [m for m in self.base.modules() if m.__class__.__name__.endswith("SelfAttention")]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                spans: PackedSpans) -> torch.Tensor:
        """The hidden states ``[T, hidden]`` of packed prompts (``positions`` restart at
        0 with each prompt)."""
        with spans_in_effect(spans):
            out = self.base(input_ids=input_ids.unsqueeze(0), position_ids=(positions + self.first_position).unsqueeze(0),
                            token_type_ids=token_type_ids.unsqueeze(0))
        return out.last_hidden_state[0]

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """A classifier's logits of its prompts' first-token states ``[N, hidden]``
        (BERT: its pooler and classifier; RoBERTa: its classification head, which takes
        the first token itself)."""
        model = self.model
        if getattr(self.base, "pooler", None) is not None:  # BERT: dense + tanh over the first token
            return model.classifier(self.base.pooler(first.unsqueeze(1)))
        return model.classifier(first.unsqueeze(1))


def fuse_qkv(model: nn.Module) -> int:
    """Each BERT-family self-attention's ``query``, ``key`` and ``value`` projections
    stacked into one linear (``qkv``: one matmul a layer instead of three), the module
    running ``fused_self_attention``; returns how many were fused."""
    fused = 0
    for module in model.modules():
        parts = [getattr(module, name, None) for name in ("query", "key", "value")]
        if not module.__class__.__name__.endswith("SelfAttention") or not all(type(p) is nn.Linear for p in parts):
            continue
        if len({p.bias is None for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
            continue
        qkv = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                        device="meta", dtype=parts[0].weight.dtype)
        qkv.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
        if qkv.bias is not None:
            qkv.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
        del module.query, module.key, module.value
        module.qkv = qkv
        module.forward = types.MethodType(fused_self_attention, module)
        fused += 1
    return fused


def fused_self_attention(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A BERT-family self-attention's forward over packed prompts, its projections one
    matmul (``fuse_qkv``)."""
    shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
    q, k, v = (x.view(shape).transpose(1, 2) for x in self.qkv(hidden_states).split(self.all_head_size, dim=-1))
    out, _ = packed_attention(self, q, k, v, None, scaling=self.scaling)
    return out.reshape(*hidden_states.shape[:-1], -1), None


def load_encoder(path: str, task: str, dtype: torch.dtype, kwargs: dict[str, Any]) -> nn.Module:
    """transformers' base model (embed) or sequence-classification model (classify)
    from ``path``, attending through ``packed_attention``, its projections stacked
    (``fuse_qkv``)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    register_packed_attention()
    cls = AutoModelForSequenceClassification if task == "classify" else AutoModel
    try:
        model = cls.from_pretrained(path, dtype=dtype, attn_implementation=PACKED_ATTENTION, **kwargs).eval()
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise PoolingModelError(f"cannot load {path} as an encoder ({task}): {exc}") from None
    fuse_qkv(model)
    return model


def load_dense_layers(folder: str, dtype: torch.dtype, device: torch.device) -> list[tuple[nn.Linear, nn.Module]]:
    """A sentence-transformers folder's Dense modules as (linear, activation) pairs."""
    out = []
    for cfg in dense_layers(folder):
        linear = nn.Linear(cfg["in_features"], cfg["out_features"], bias=bool(cfg.get("bias", True)))
        state = _dense_weights(cfg["folder"])
        try:
            linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
        except RuntimeError as exc:
            raise PoolingModelError(f"{cfg['folder']}: the Dense module's weights do not fit its config: {exc}") from None
        act = nn.Tanh() if cfg["activation_function"].endswith("Tanh") else nn.Identity()
        out.append((linear.to(device=device, dtype=dtype).eval(), act))
    return out


def _dense_weights(folder: str) -> dict[str, torch.Tensor]:
    path = os.path.join(folder, "model.safetensors")
    if os.path.isfile(path):
        from safetensors.torch import load_file

        return load_file(path)
    path = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    raise PoolingModelError(f"{folder}: a Dense module without weights (model.safetensors or pytorch_model.bin)")
