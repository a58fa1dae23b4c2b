"""Modules over quantized weights: ``QuantizedLinear`` and ``QuantizedEmbedding``, the
torch path any device runs.

A quantized checkpoint loads into these in place of ``nn.Linear`` and ``nn.Embedding``
(``worker/quant/`` readers), so the transformers forward runs unchanged. Their forward
is the reference: it dequantizes (``QuantizedWeight.dequantize``, exact) and calls
``F.linear``, a slice of the outputs at a time so no whole float copy of a large layer
is ever held. A backend with its own kernel swaps them for faster modules
(``worker/cpu/quant_linear.py``), which must give these results up to summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.quant.weight import QuantizedWeight

#: Float elements of a dequantized slice of a layer (16 MiB in float32).
SLICE_ELEMENTS = 4 * 2**20


class QuantizedLinear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` kept quantized."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        """``bias``: float32 ``[out_features]``; a Parameter is kept as it is (a loader
        may fill it after this module is built)."""
        super().__init__()
        self.quantized = weight
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:  # for code that reads shapes and dtype off a linear
        return torch.empty(self.out_features, self.in_features, dtype=torch.float32, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        dtype = rows.dtype
        rows = rows.float()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        step = max(1, SLICE_ELEMENTS // max(1, self.in_features))
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            w = self.quantized.dequantize(slice(start, stop)).to(x.device)
            bias = None if self.bias is None else self.bias[start:stop].float().to(x.device)
            out[:, start:stop] = F.linear(rows, w, bias)
        return out.to(dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quantized.format}"


def embedding_scale(module: nn.Module) -> float | None:
    """The factor a scaled embedding multiplies its rows by (Gemma's sqrt(hidden):
    ``embed_scale``); None for a plain one."""
    scale = getattr(module, "embed_scale", None)
    if scale is None:
        return None
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized: the rows a step looks up are dequantized (and
    multiplied by ``scale`` where the model's embedding scales them: Gemma's)."""

    def __init__(self, weight: QuantizedWeight, padding_idx: int | None = None, scale: float | None = None) -> None:
        super().__init__()
        self.quantized = weight
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features
        self.padding_idx = padding_idx
        self.scale = scale

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=torch.float32, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        rows = self.quantized.dequantize(flat).to(ids.device).view(*ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.quantized.format}"


def quantized_formats(model: nn.Module) -> dict[str, int]:
    """``model``'s layers kept quantized, counted by format (a shared one once)."""
    seen: set[int] = set()
    formats: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and id(module.quantized) not in seen:
            seen.add(id(module.quantized))
            formats[module.quantized.format] = formats.get(module.quantized.format, 0) + 1
    return formats
