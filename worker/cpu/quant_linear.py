"""Quantized linear layers on the CPU kernel (``csrc/quant_linear.cpp``).

``QuantPanelLinear`` takes a ``QuantizedLinear``'s weight into column panels once at load
(each run of 16 outputs' codes together, and each group's scales and offsets in one
64-byte line where they are exact in half precision) and runs calls of fewer than
``gemm_from_rows`` rows on the kernel: the weights are read quantized, once per call,
and the result is the float panel linear's on the dequantized weights, bit for bit.
Below 32 rows the kernel dequantizes each weight in registers; from 32 rows it
dequantizes a pair of panels once into a buffer and runs the float panel kernel's blocks
of rows over it (the same values and sums: a row's result does not depend on which).
Calls of ``gemm_from_rows`` rows or more (long prefill chunks) run a library GEMM on the
dequantized weights a slice of the outputs at a time.

``quantize_linear_layers`` swaps every ``QuantizedLinear`` of a model for one of these
where the kernel applies (output sizes a multiple of 16, groups of an even size); an
input embedding tied to the output layer then looks its rows up in that layer's panels
(``QuantPanelEmbedding``), so the table is held once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from worker.quant.linear import SLICE_ELEMENTS, QuantizedEmbedding, QuantizedLinear
from worker.quant.weight import QuantizedWeight

logger = logging.getLogger("raydecode")

#: Rows from which a quantized layer's call runs the library GEMM on dequantized weights
#: (at least; ``cpu_gemm_from_rows`` may ask for more): below, the kernel's in-register
#: dequantization is ahead (docs/performance.md, "Quantized weights").
GEMM_FROM_ROWS = 512


class QuantPanelLinear(nn.Module):
    """A ``QuantizedLinear`` whose weight lives in the CPU kernel's panels."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, ops: Any, gemm_from_rows: int = 0) -> None:
        super().__init__()
        self.ops = ops
        # Only the panels are kept: the source's tensors go (sharding and merging are done).
        self.format = weight.format
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.group_size = weight.group_size
        self.codes = ops.pack_quant_panels(weight.codes)
        #: each group's scales and offsets together (float16 where every value is exact)
        self.groups = ops.pack_quant_groups(weight.scales, weight.offsets)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.gemm_from_rows = gemm_from_rows

    @classmethod
    def of(cls, linear: QuantizedLinear, ops: Any, gemm_from_rows: int = 0) -> QuantPanelLinear:
        return cls(linear.quantized, linear.bias, ops, gemm_from_rows)

    @staticmethod
    def applies(weight: QuantizedWeight, ops: Any | None) -> bool:
        return (ops is not None and hasattr(ops, "quant_linear") and weight.out_features % 16 == 0
                and (not weight.packed or weight.group_size % 2 == 0))

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.out_features, self.in_features, dtype=torch.float32, device="meta")

    def matmul(self, rows: torch.Tensor, isa: str = "") -> torch.Tensor:
        """``rows`` [M, in] (contiguous float32) @ W^T + bias."""
        if self.gemm_from_rows and rows.shape[0] >= self.gemm_from_rows:
            return self._library_gemm(rows)
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        self.ops.quant_linear(out, rows, self.codes, self.groups, self.bias, self.group_size, isa)
        return out

    def _library_gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """A prefill-sized call: the dequantized weights, a slice of panels at a time,
        through the library GEMM (``torch.mm`` on ``W^T``, the panels' own orientation)."""
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        panels = self.codes.shape[0]
        step = max(1, SLICE_ELEMENTS // (16 * self.in_features))
        for p0 in range(0, panels, step):
            p1 = min(p0 + step, panels)
            wt = self.ops.dequantize_quant_panels(self.codes, self.groups, self.group_size, p0, p1)  # W^T
            part = torch.mm(rows, wt)
            if self.bias is not None:
                part += self.bias[p0 * 16 : p1 * 16]
            out[:, p0 * 16 : p1 * 16] = part
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        return self.matmul(rows).to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format}, panels"


class QuantPanelEmbedding(nn.Module):
    """An input embedding tied to the output layer, looked up in that layer's panels: the
    table is stored once (``QuantizedEmbedding`` would keep its own copy)."""

    def __init__(self, head: QuantPanelLinear, padding_idx: int | None = None, scale: float | None = None) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = padding_idx
        self.scale = scale  # Gemma's sqrt(hidden), as QuantizedEmbedding's

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=torch.float32, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.head
        rows = h.ops.quant_panel_rows(h.codes, h.groups, h.group_size, ids.reshape(-1).long().cpu())
        rows = rows.to(ids.device).view(*ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)


def quantize_linear_layers(model: nn.Module, ops: Any, gemm_from_rows: int = 0) -> int:
    """Swaps every ``QuantizedLinear`` of ``model`` the kernel can run for a
    ``QuantPanelLinear`` (a layer shared by several parents, once); returns how many.
    The output embedding keeps the kernel at every size (only sampled rows reach it); the
    others take the library GEMM from ``max(gemm_from_rows, GEMM_FROM_ROWS)`` rows
    (never, with ``gemm_from_rows`` 0)."""
    if ops is None or not hasattr(ops, "quant_linear"):
        return 0
    output_embedding = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    input_embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = (isinstance(input_embedding, QuantizedEmbedding) and isinstance(output_embedding, QuantizedLinear)
            and input_embedding.quantized is output_embedding.quantized)
    swapped: dict[int, QuantPanelLinear] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, QuantizedLinear) or not QuantPanelLinear.applies(child.quantized, ops):
                continue
            if id(child) not in swapped:
                rows = 0 if child is output_embedding or not gemm_from_rows else max(gemm_from_rows, GEMM_FROM_ROWS)
                swapped[id(child)] = QuantPanelLinear.of(child, ops, rows)
            setattr(parent, name, swapped[id(child)])
    if tied and id(output_embedding) in swapped:  # the table once, in the output layer's panels
        model.set_input_embeddings(QuantPanelEmbedding(swapped[id(output_embedding)], input_embedding.padding_idx,
                                                        input_embedding.scale))
    return len(swapped)
