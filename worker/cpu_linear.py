"""Prepacked oneDNN weights for the model's linear layers on CPU.

``F.linear`` on CPU re-reads a row-major weight for every call; torch's own oneDNN
linear with the weight reordered once into its blocked layout (what inductor's
"freezing" does) runs the same float32 matmul 2-3.5x faster at 1-64 rows on this
machine (``tests/bench/worker_step.py`` prints the per-shape numbers). Results equal
``F.linear`` up to float32 rounding (summation order).

bfloat16 weights are packed too where oneDNN has a native bf16 matmul (AVX512-BF16 or
AMX: ``packable_dtypes``): there the packed bf16 linear runs about twice the float32
rate (415 against 211 GFLOPS at 64-512 rows on this project's 2-core Zen 4 VM) and reads
half the bytes at one row. Without those instructions bf16 would only be converted to
float32 and back, and stays ``F.linear``.

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


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes ``pack_linear_layers`` packs on this CPU: float32, and bfloat16
    where oneDNN runs it natively."""
    if not packed_linear_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


#: (rtol, atol) of the load-time check of a packed linear against ``F.linear``: float32
#: differs by summation order; bfloat16 outputs are rounded to 8 bits of mantissa, so
#: one rounding step apart (2**-8 relative) is the same answer.
PACK_CHECK_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


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


def _first_of_each_dtype(targets: list[tuple[nn.Module, str, nn.Linear]]) -> list[nn.Linear]:
    first: dict[torch.dtype, nn.Linear] = {}
    for _, _, child in targets:
        first.setdefault(child.weight.dtype, child)
    return list(first.values())


def _packs_correctly(probe: nn.Linear) -> bool:
    """Whether the packed op gives ``F.linear``'s answer for ``probe``."""
    dtype = probe.weight.dtype
    x = torch.randn(3, probe.in_features).to(dtype)
    rtol, atol = PACK_CHECK_TOLERANCE[dtype]
    try:
        got = PackedLinear(probe)(x)
    except RuntimeError:
        return False
    want = F.linear(x, probe.weight, probe.bias)
    return got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol)


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
    """Swaps every CPU ``nn.Linear`` of ``model`` whose dtype this CPU packs
    (``packable_dtypes``) for a ``PackedLinear`` (inference only; a merged linear shared
    by its slices is packed once); returns how many it packed. Checks the first one of
    each dtype against ``F.linear`` and leaves the model untouched if the op misbehaves."""
    dtypes = packable_dtypes()
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype in dtypes
        and child.weight.device.type == "cpu"
    ]
    if not targets or not all(_packs_correctly(probe) for probe in _first_of_each_dtype(targets)):
        return 0
    packed_by_id: dict[int, PackedLinear] = {}  # a merged linear is a child of each of its slices
    for parent, name, child in targets:
        if id(child) not in packed_by_id:
            packed_by_id[id(child)] = PackedLinear(child)
        setattr(parent, name, packed_by_id[id(child)])
    return len(packed_by_id)
