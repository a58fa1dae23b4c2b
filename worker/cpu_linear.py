"""Prepacked oneDNN weights for the model's linear layers on CPU.

``F.linear`` on CPU re-reads a row-major weight for every call; torch's own oneDNN
linear with the weight reordered once into its blocked layout (what inductor's
"freezing" does) runs the same float32 matmul 2-3.5x faster at 1-64 rows on this
machine (``tests/bench/worker_step.py`` prints the per-shape numbers). Results equal
``F.linear`` up to float32 rounding (summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packed_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight lives in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 32) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def weight(self) -> torch.Tensor:  # for code that reads shapes off a linear's weight
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linear_layers(model: nn.Module) -> int:
    """Swaps every float32 CPU ``nn.Linear`` of ``model`` for a ``PackedLinear``
    (inference only); returns how many were swapped. Checks the first one against
    ``F.linear`` and leaves the model untouched if the op misbehaves."""
    if not packed_linear_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.float32
        and child.weight.device.type == "cpu"
    ]
    if not targets:
        return 0
    probe = targets[0][2]
    x = torch.randn(3, probe.in_features)
    try:
        packed = PackedLinear(probe)
        ok = torch.allclose(packed(x), F.linear(x, probe.weight, probe.bias), rtol=1e-4, atol=1e-4)
    except RuntimeError:
        ok = False
    if not ok:
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
