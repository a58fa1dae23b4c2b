"""Prepacked oneDNN weights for the model's linear layers on CPU.

``F.linear`` on CPU re-reads a row-major weight for every call; torch's own oneDNN
linear with the weight reordered once into its blocked layout (what inductor's
"freezing" does) runs the same float32 matmul 2-3.5x faster at 1-64 rows on this
machine (``tests/bench/worker_step.py`` prints the per-shape numbers). Results equal
``F.linear`` up to float32 rounding (summation order).

Projections that read the same input (a layer's q, k and v; its MLP's gate and up) can
be stacked into one linear first (``merge_linears``, for the fused decoder): one
matmul call instead of three or two, which at one to a few rows, where each call reads
its weights and pays its dispatch, is 5-9% of a decode step. Each projection stays a
module of the model (``LinearSlice``: its columns of the merged output), so the weights
exist once and the transformers forward still runs.
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


class LinearSlice(nn.Module):
    """Output features ``[start, stop)`` of a merged linear (``merge_linears``):
    one projection of several stacked into one matmul. Called alone it runs the whole
    merged linear and returns its columns (a view): the transformers forward, which
    calls q, k and v one by one, stays correct; the fused decoder runs ``merged`` once
    and splits it."""

    def __init__(self, merged: nn.Module, start: int, stop: int) -> None:
        super().__init__()
        self.merged = merged
        self.start, self.stop = start, stop
        self.in_features = merged.in_features
        self.out_features = stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merged(x)[..., self.start : self.stop]


def merge_linears(parent: nn.Module, names: tuple[str, ...]) -> bool:
    """Replaces ``parent``'s linears ``names`` (plain ``nn.Linear`` over the same input
    size, dtype and device, all with a bias or none) with ``LinearSlice``s of one
    ``nn.Linear`` whose weight stacks theirs in that order; False (nothing changed)
    where they do not qualify."""
    parts = [getattr(parent, name, None) for name in names]
    if any(type(p) is not nn.Linear for p in parts):
        return False
    first = parts[0].weight
    if any(p.in_features != parts[0].in_features or p.weight.dtype != first.dtype or p.weight.device != first.device
           for p in parts):
        return False
    if len({p.bias is None for p in parts}) != 1:
        return False
    # Built on the meta device and given the stacked tensors: no random initialisation
    # to overwrite, and no second copy of the weights while loading.
    merged = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                       device="meta", dtype=first.dtype)
    merged.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
    if merged.bias is not None:
        merged.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    start = 0
    for name, part in zip(names, parts):
        setattr(parent, name, LinearSlice(merged, start, start + part.out_features))
        start += part.out_features
    return True


def merged_parts(parts: list[nn.Module]) -> tuple[nn.Module, list[int]] | None:
    """``(merged linear, output sizes)`` when ``parts`` are, in order, the consecutive
    slices covering one merged linear; else None."""
    if not parts or any(not isinstance(p, LinearSlice) or p.merged is not parts[0].merged for p in parts):
        return None
    bounds = [(p.start, p.stop) for p in parts]
    if bounds[0][0] != 0 or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    merged = parts[0].merged
    if bounds[-1][1] != merged.out_features:
        return None
    return merged, [p.out_features for p in parts]


def pack_linear_layers(model: nn.Module) -> int:
    """Swaps every float32 CPU ``nn.Linear`` of ``model`` for a ``PackedLinear``
    (inference only; a merged linear shared by its slices is packed once); returns
    how many it packed. Checks the first one against ``F.linear`` and leaves the model
    untouched if the op misbehaves."""
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
    packed_by_id: dict[int, PackedLinear] = {}  # a merged linear is a child of each of its slices
    for parent, name, child in targets:
        if id(child) not in packed_by_id:
            packed_by_id[id(child)] = PackedLinear(child)
        setattr(parent, name, packed_by_id[id(child)])
    return len(packed_by_id)
