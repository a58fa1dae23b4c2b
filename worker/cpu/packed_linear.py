"""Prepacked weights for the model's linear layers on CPU.

``F.linear`` on CPU re-reads a row-major weight for every call; a weight reordered once
into a layout its kernel streams runs the same matmul faster. Three packings:

- float32: column panels (``PanelLinear``, ``worker/cpu/csrc/panel_linear.cpp``): each
  run of 16 output columns stored as one contiguous ``[K, 16]`` block, read once per
  block of up to 12 rows with every weight vector feeding those rows' FMAs from
  registers. At decode sizes a step is bound by reading the weights, and the panels
  read them faster than oneDNN's packed linear (the next panels prefetched while a
  pair's later row blocks compute). At prefill sizes (calls bound by the FMA units) a
  library GEMM over its own packed copy is ahead, so calls of ``gemm_from_rows`` rows or
  more run there (``large_call_gemm``), kept beside the panels. Each panel output is one
  chain of FMAs over k in order, so a row's result does not depend on the batch it is
  in. The panel pairs are split over the threads in contiguous runs, a thread done
  early taking the other's from the back (``worker/cpu/csrc/work_split.h``). Needs the
  CPU kernels (``worker/cpu/kernels.py`` builds them) and output sizes that are
  multiples of 16; otherwise oneDNN's packing serves.
- float32, large calls: a library GEMM over its own packed copy, the faster on this
  CPU of MKL's packed sgemm (``MklPackedWeight``: ``cblas_sgemm_pack`` and ``_compute``
  through torch's ``mkl::_mkl_linear``, what inductor's freezing uses for float32
  linears on x86) and oneDNN's packed linear, raced at load (``choose_gemm_library``):
  MKL leads on an Intel Xeon, oneDNN by more than 2x on an AMD Zen 5 (where MKL keeps
  off AVX-512). oneDNN's copy stands in where MKL is missing or fails the load-time
  check.
- oneDNN (``PackedLinear``): torch's own oneDNN linear with the weight reordered once
  into its blocked layout (what inductor's "freezing" does), faster than ``F.linear`` at
  decode sizes in float32 (``tests/bench/worker_step.py`` compares them).

Results equal ``F.linear`` up to float32 rounding (summation order).

bfloat16 weights are packed too where oneDNN has a native bf16 matmul (AVX512-BF16 or
AMX: ``packable_dtypes``): there the packed bf16 linear computes faster than float32
and reads half the bytes at one row. Without those instructions bf16 would only be
converted to float32 and back, and stays ``F.linear``.

Projections that read the same input (a layer's q, k and v; its MLP's gate and up) can
be stacked into one linear first (``merge_linears``, for the fused decoder): one
matmul call instead of three or two, a saving that shows in a decode step at one to a
few rows, where each call reads its weights and pays its dispatch. Each projection stays
a module of the model (``LinearSlice``: its columns of the merged output), so the
weights exist once and the transformers forward still runs.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.quant.linear import QuantizedLinear
from worker.quant.weight import can_stack, stack_outputs

logger = logging.getLogger("raydecode")


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


def mkl_packed_linear_available() -> bool:
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


#: The row count MKL's copy is packed for. Its packed B matrix serves any row count
#: (``_mkl_gemm_serves_any_rows`` checks this at load: MKL documents the packing per
#: call shape, and torch's op uses the packed copy only for calls of the packed size).
MKL_PACK_ROWS = 512


class MklPackedWeight:
    """A float32 weight (and bias) packed for MKL's sgemm; called with ``rows`` [M, in]
    (contiguous float32) it returns ``rows @ W^T + bias``."""

    def __init__(self, linear: nn.Linear) -> None:
        weight = linear.weight.detach().contiguous()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
        # torch's op takes the original weight too, for its shape and dtype and for its
        # fallback (``at::linear``) when a call's rows differ from the packed size.
        # Every call here passes its own row count as that size, so the fallback never
        # runs: a zero-stride view stands in for the weight (no second copy of it).
        self.shape_only = torch.zeros((), dtype=weight.dtype).expand(weight.shape)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(rows, self.packed, self.shape_only, self.bias, rows.shape[0])


def _mkl_gemm_serves_any_rows(probe: nn.Linear) -> bool:
    """Whether MKL's packed copy of ``probe`` gives ``F.linear``'s answer at row counts
    other than the one it was packed for (odd, small, and past it)."""
    return (mkl_packed_linear_available() and probe.weight.dtype == torch.float32
            and _packs_correctly(probe, MklPackedWeight, rows=(1, 37, MKL_PACK_ROWS, MKL_PACK_ROWS + 19)))


def large_call_gemm(linear: nn.Linear, use_mkl: bool) -> Any:
    """What a panel linear hands its calls of ``gemm_from_rows`` rows or more:
    MKL's packed sgemm (``use_mkl``: checked at load), else oneDNN's packed linear."""
    return MklPackedWeight(linear) if use_mkl else PackedLinear(linear)


#: Rows of the load-time race between the two libraries (a long prefill chunk).
GEMM_PROBE_ROWS = 512
#: Timed calls of each library in that race (interleaved, after one warm-up each).
GEMM_PROBE_ROUNDS = 5


def time_gemms(probe: nn.Linear, rows: int = GEMM_PROBE_ROWS, rounds: int = GEMM_PROBE_ROUNDS) -> dict[str, float]:
    """Seconds per call of ``probe`` at ``rows`` rows with MKL's packed copy and
    oneDNN's (the best of ``rounds`` interleaved calls each, on this thread's torch
    threads, as the worker's steps run them)."""
    kinds = {"mkl": MklPackedWeight(probe), "onednn": PackedLinear(probe)}
    x = torch.randn(rows, probe.in_features)
    best = {k: math.inf for k in kinds}
    for i in range(rounds + 1):
        for name, gemm in kinds.items():
            t0 = time.perf_counter()
            gemm(x)
            if i:  # the first round warms up (packing, page faults, code)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def choose_gemm_library(probe: nn.Linear, library: str) -> tuple[bool, str]:
    """``(use_mkl, why)`` for the large calls, where both libraries passed their
    load-time checks. ``library``: "mkl", "onednn", or "auto": the faster on this CPU
    at ``GEMM_PROBE_ROWS`` rows (``time_gemms`` on ``probe``, the model's largest panel
    linear). Neither is ahead everywhere: MKL's packed sgemm led oneDNN by ~15% on an
    Intel Xeon (AMX), yet ran at less than half of oneDNN's speed on an AMD Zen 5,
    where MKL does not take its AVX-512 code path."""
    if library != "auto":
        return library == "mkl", f"{'MKL' if library == 'mkl' else 'oneDNN'} (cpu_gemm_library)"
    t = time_gemms(probe)
    use_mkl = t["mkl"] < t["onednn"]
    return use_mkl, (f"{'MKL' if use_mkl else 'oneDNN'} ({t['mkl'] * 1e3:.2f} ms MKL, {t['onednn'] * 1e3:.2f} ms "
                     f"oneDNN for {probe.out_features}x{probe.in_features} at {GEMM_PROBE_ROWS} rows)")


class PanelLinear(nn.Module):
    """A frozen float32 ``nn.Linear`` whose weight lives in column panels
    ``[out / 16, in, 16]``, run by the CPU kernel ``ops.panel_linear``.

    With ``gemm_from_rows`` > 0 it also keeps a library GEMM's packed copy of the
    weight (``large_call_gemm``: MKL's with ``use_mkl``, else oneDNN's) and runs calls
    of at least that many rows (prefill chunks) there: the panels are ahead while
    reading the weights bounds a call, the library GEMM once the FMA units do
    (``tests/bench/panel_linear.py``)."""

    def __init__(self, linear: nn.Linear, ops: Any, gemm_from_rows: int = 0, use_mkl: bool = False) -> None:
        super().__init__()
        self.ops = ops
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.panels = ops.pack_panels(linear.weight.detach().contiguous())
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.gemm_from_rows = gemm_from_rows
        self.gemm = large_call_gemm(linear, use_mkl) if gemm_from_rows > 0 else None

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [M, in] (contiguous float32) @ W^T + bias."""
        if self.gemm is not None and rows.shape[0] >= self.gemm_from_rows:
            return self.gemm(rows)
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        self.ops.panel_linear(out, rows, self.panels, self.bias)
        return out

    @property
    def weight(self) -> torch.Tensor:  # for code that reads shapes and dtype off a linear
        return torch.empty(self.out_features, self.in_features, dtype=self.panels.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        return self.matmul(rows).view(*x.shape[:-1], self.out_features)

    @staticmethod
    def applies(linear: nn.Linear, ops: Any | None) -> bool:
        return (ops is not None and hasattr(ops, "panel_linear") and linear.weight.dtype == torch.float32
                and linear.weight.device.type == "cpu" and linear.out_features % 16 == 0)


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
    size, dtype and device, all with a bias or none; or ``QuantizedLinear``s whose
    weights stack: ``worker/quant/weight.py``) with ``LinearSlice``s of one linear whose
    weight stacks theirs in that order; False (nothing changed) where they do not
    qualify."""
    parts = [getattr(parent, name, None) for name in names]
    if all(isinstance(p, QuantizedLinear) for p in parts):
        return _merge_quantized(parent, names, parts)
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


def _merge_quantized(parent: nn.Module, names: tuple[str, ...], parts: list[QuantizedLinear]) -> bool:
    if not can_stack([p.quantized for p in parts]) or len({p.bias is None for p in parts}) != 1:
        return False
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach().float() for p in parts])
    merged = QuantizedLinear(stack_outputs([p.quantized for p in parts]), bias)
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


def _packs_correctly(probe: nn.Linear, pack: Any = None, rows: tuple[int, ...] = (3,)) -> bool:
    """Whether the packed op (``pack(probe)``, oneDNN's by default) gives
    ``F.linear``'s answer for ``probe``, called with each of ``rows`` rows."""
    dtype = probe.weight.dtype
    rtol, atol = PACK_CHECK_TOLERANCE[dtype]
    try:
        packed = (pack or PackedLinear)(probe)
        for m in rows:
            x = torch.randn(m, probe.in_features).to(dtype)
            got = packed(x)
            want = F.linear(x, probe.weight, probe.bias)
            if got.dtype != dtype or not torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol):
                return False
    except RuntimeError:
        return False
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


def pack_linear_layers(model: nn.Module, panel_ops: Any = None, gemm_from_rows: int = 0,
                       gemm_library: str = "auto") -> int:
    """Swaps every CPU ``nn.Linear`` of ``model`` for a packed one (inference only; a
    merged linear shared by its slices is packed once): a ``PanelLinear`` where
    ``panel_ops`` (the CPU kernels) can run it, else a ``PackedLinear`` where this CPU
    packs its dtype (``packable_dtypes``). Returns how many it packed. The first one of
    each kind and dtype is checked against ``F.linear``; a kind that misbehaves is not
    used (the layers stay as they are, or get the other kind). ``gemm_from_rows``
    (> 0): panel linears keep a library GEMM's copy too, for calls of that many rows or
    more (not the output embedding: only sampled rows reach it): MKL's where it serves
    every shape of the model at any row count and ``gemm_library`` picks it
    (``choose_gemm_library``), else oneDNN's."""
    dtypes = packable_dtypes()
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        # (an empty one, a zero-width shared expert, stays: oneDNN cannot pack it)
        if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.numel() > 0
    ]
    panel = [t for t in targets if PanelLinear.applies(t[2], panel_ops)]
    if panel and not _packs_correctly(panel[0][2], lambda lin: PanelLinear(lin, panel_ops)):
        panel = []
    panel_ids = {id(t[2]) for t in panel}
    output_embedding = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    use_mkl = False
    if panel and gemm_from_rows > 0:
        shapes = {(t[2].out_features, t[2].in_features): t[2] for t in panel if t[2] is not output_embedding}
        mkl_serves = gemm_library != "onednn" and bool(shapes) and all(
            _mkl_gemm_serves_any_rows(probe) for probe in shapes.values())
        onednn_serves = torch.float32 in dtypes and _packs_correctly(panel[0][2])
        use_mkl = mkl_serves
        if mkl_serves and onednn_serves:
            largest = max(shapes.values(), key=lambda lin: lin.in_features * lin.out_features)
            use_mkl, why = choose_gemm_library(largest, gemm_library)
            logger.warning("float32 linears called with %d rows or more: %s", gemm_from_rows, why)
        if not use_mkl and not onednn_serves:
            gemm_from_rows = 0  # no working float32 library packing here: panels at every size
    onednn = [t for t in targets if id(t[2]) not in panel_ids and t[2].weight.dtype in dtypes]
    if onednn and not all(_packs_correctly(probe) for probe in _first_of_each_dtype(onednn)):
        onednn = []
    packed_by_id: dict[int, nn.Module] = {}  # a merged linear is a child of each of its slices
    for parent, name, child in panel + onednn:
        if id(child) not in packed_by_id:
            if id(child) in panel_ids:
                rows = 0 if child is output_embedding else gemm_from_rows
                packed_by_id[id(child)] = PanelLinear(child, panel_ops, rows, use_mkl)
            else:
                packed_by_id[id(child)] = PackedLinear(child)
        setattr(parent, name, packed_by_id[id(child)])
    return len(packed_by_id)
