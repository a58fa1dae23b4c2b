"""Quantizing a float checkpoint's linear layers at load: ``int8`` (per output channel,
symmetric) and ``int4`` (groups along the inputs, symmetric by default).

- int8: ``scale = max |w| / 127`` per output row, codes ``round(w / scale)`` in
  ``[-127, 127]`` (stored shifted by 128, the shift in the offset).
- int4: per group of ``group_size`` inputs (128 by default), symmetric ``scale = max |w|
  / 7``, codes ``round(w / scale)`` in ``[-8, 7]``; asymmetric (``symmetric: False``)
  ``scale = (max - min) / 15`` over the group's range widened to hold 0, and an integer
  zero point, codes in ``[0, 15]``. Where the
  group size does not divide a layer's inputs (SmolLM2's 576 by 128), the layer takes the
  largest even divisor of its inputs below it, and the load report says so.

Scales are rounded to half precision, as the formats that store them do, which keeps
``scale * code`` exact in float32 (``QuantizedWeight``). The decoder layers' linear layers
are quantized; embeddings and the output layer stay as they are (as vLLM's on-the-fly
quantization leaves them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.config import check_quantization_options as check_options
from worker.quant.linear import QuantizedLinear
from worker.quant.weight import QuantizedWeight

DEFAULT_INT4_GROUP = 128


def _half_scales(scale: torch.Tensor) -> torch.Tensor:
    """Scales rounded to half precision (a zero scale, from an all-zero group, stays
    representable: any code times it is zero)."""
    return scale.clamp(min=2.0**-24).to(torch.float16).float()


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    w = weight.detach().float()
    scale = _half_scales(w.abs().amax(dim=1, keepdim=True) / 127)
    q = torch.clamp(torch.round(w / scale), -127, 127)
    return QuantizedWeight.from_codes((q + 128).to(torch.uint8), scale, -128 * scale, 8, w.shape[1], "int8 per-channel")


def int4_group(in_features: int, group_size: int) -> int:
    """``group_size``, or the largest even divisor of ``in_features`` below it."""
    if in_features % group_size == 0:
        return group_size
    divisors = [g for g in range(2, group_size, 2) if in_features % g == 0]
    if not divisors:
        raise ValueError(f"int4: a layer of {in_features} inputs has no even group size up to {group_size}")
    return max(divisors)


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP, symmetric: bool = True) -> QuantizedWeight:
    w = weight.detach().float()
    n, k = w.shape
    g = int4_group(k, group_size)
    groups = w.reshape(n, k // g, g)
    if symmetric:
        scale = _half_scales(groups.abs().amax(dim=2) / 7)
        q = torch.clamp(torch.round(groups / scale[..., None]), -8, 7) + 8
        offset = -8 * scale
    else:
        # The range holds 0 (as the compressed-tensors package's observer makes it), so
        # the zero point is a code and a group of one sign keeps its extreme in range.
        lo, hi = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
        scale = _half_scales((hi - lo) / 15)
        zero = torch.clamp(torch.round(-lo / scale), 0, 15)
        q = torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, 15)
        offset = -zero * scale
    name = f"int4 g{g} {'sym' if symmetric else 'asym'}"
    return QuantizedWeight.from_codes(q.reshape(n, k).to(torch.uint8), scale, offset, 4, g, name)


def quantize_model(model: nn.Module, scheme: str, options: dict[str, Any] | None = None) -> dict[str, int]:
    """Replaces the linear layers of ``model``'s decoder layers with quantized ones;
    returns how many of each format."""
    options = check_options(scheme, options)
    skip = {id(model.get_output_embeddings())} if hasattr(model, "get_output_embeddings") else set()
    formats: dict[str, int] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or id(child) in skip:
                continue
            if scheme == "int8":
                q = quantize_int8(child.weight)
            else:
                q = quantize_int4(child.weight, options.get("group_size", DEFAULT_INT4_GROUP),
                                  options.get("symmetric", True))
            setattr(parent, name, QuantizedLinear(q, child.bias))
            formats[q.format] = formats.get(q.format, 0) + 1
    return formats


def quantize_output_layer(model: nn.Module, scheme: str, options: dict[str, Any] | None = None) -> str | None:
    """Quantizes ``model``'s output layer (the LM head) with ``scheme`` (a tied input
    embedding keeps its float table); returns the format, or None when the model has
    no float linear output layer. For a draft model: its LM head is most of the bytes
    a quantized draft reads per token, and a draft only needs its argmax."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return None
    options = check_options(scheme, options)
    if scheme == "int8":
        q = quantize_int8(head.weight)
    else:
        q = quantize_int4(head.weight, options.get("group_size", DEFAULT_INT4_GROUP), options.get("symmetric", True))
    model.set_output_embeddings(QuantizedLinear(q, head.bias))
    return q.format
