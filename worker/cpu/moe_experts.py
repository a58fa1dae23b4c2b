"""A mixture-of-experts layer's experts in one native call (``csrc/moe_experts.cpp``).

``worker/runner/experts.py`` turns each expert's projections into linears, which
``packed_linear.py`` packs into column panels; its Python forward then runs some 25
small ops a layer (sorting the step's (token, expert) pairs, a gather, two matmuls and
a gate per expert, a scatter), and at one to a few rows their dispatch costs more than
the matmuls. ``install_native_experts`` gives every experts module whose linears are
all float32 panels, and whose gate the kernel knows, a ``native_experts`` callable that
does the whole layer's experts in one call: the pairs counting-sorted by expert, the
active experts' up projections split over the threads as one list of panel units, the
gates, the down projections the same way, each token's outputs summed in rank order.

Results are the Python loop's up to float32 rounding (the gates' exponentials are the
kernels' own, as in the fused decoder's dense MLP), batch-invariant the same way (each
row one chain of FMAs, the sum in rank order). A step in which an expert receives
``gemm_from_rows`` rows or more (a long prefill) goes back to the Python loop, whose
panel linears hand such calls to a library GEMM: what each row computes is then what
the per-expert linears would, on either path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.cpu.packed_linear import PanelLinear
from worker.runner.experts import expert_range


def native_gate(experts: nn.Module) -> tuple[str, float, float] | None:
    """The kernel's name for ``experts``' gate, with its alpha and limit (gpt-oss's);
    None where the kernel does not have it."""
    from transformers.activations import GELUTanh, SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(experts, "has_gate", False) or getattr(experts, "has_post_expert_norm", False):
        return None
    if type(experts).__name__ == "GptOssExperts":
        return "gpt_oss", float(experts.alpha), float(experts.limit)
    if type(experts)._apply_gate is not _default_apply_gate or not getattr(experts, "is_concatenated", True):
        return None
    act = getattr(experts, "act_fn", None)
    if isinstance(act, (SiLUActivation, nn.SiLU)):
        return "silu", 1.0, 0.0
    if isinstance(act, GELUTanh):
        return "gelu_tanh", 1.0, 0.0
    return None


class NativeExperts:
    """One experts module's panels, called with the experts interface's arguments
    (hidden states ``[T, hidden]``, ``top_k_index``, ``top_k_weights``); returns None
    when the step is one for the Python loop (see the module docstring)."""

    def __init__(self, ups: list[PanelLinear], downs: list[PanelLinear], ops: Any, gate: tuple[str, float, float],
                 first_expert: int = 0, total_experts: int = -1) -> None:
        """``first_expert``, ``total_experts``: under expert parallelism, the global
        index of this rank's first expert and the layer's count (``experts.py``)."""
        self.ops = ops
        self.first_expert, self.total_experts = first_expert, total_experts
        self.up_panels = [layer.panels for layer in ups]
        self.down_panels = [layer.panels for layer in downs]
        self.up_biases = [layer.bias for layer in ups] if ups[0].bias is not None else []
        self.down_biases = [layer.bias for layer in downs] if downs[0].bias is not None else []
        self.gate, self.alpha, self.limit = gate
        limits = [layer.gemm_from_rows for layer in ups + downs if layer.gemm is not None]
        #: an expert with this many rows in a step goes to the Python loop (0: never)
        self.gemm_from_rows = min(limits) if limits else 0

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor | None:
        if hidden_states.dtype != torch.float32:
            return None
        index = top_k_index.to(torch.int64).contiguous()
        if self.gemm_from_rows and index.numel() >= self.gemm_from_rows:
            if int(torch.bincount(index.reshape(-1)).max()) >= self.gemm_from_rows:
                return None
        x = hidden_states.contiguous()
        out = torch.empty_like(x)
        self.ops.moe_experts(out, x, index, top_k_weights.to(torch.float32).contiguous(), self.up_panels,
                             self.up_biases, self.down_panels, self.down_biases, self.gate, self.alpha, self.limit,
                             self.first_expert, self.total_experts)
        return out


def install_native_experts(model: nn.Module, ops: Any) -> int:
    """``native_experts`` on every experts module it applies to; how many."""
    if ops is None or not hasattr(ops, "moe_experts"):
        return 0
    count = 0
    for module in model.modules():
        ups, downs = getattr(module, "expert_up", None), getattr(module, "expert_down", None)
        if ups is None or downs is None:
            continue
        layers = list(ups) + list(downs)
        gate = native_gate(module)
        if gate is None or not all(isinstance(layer, PanelLinear) for layer in layers):
            continue
        if len({layer.bias is None for layer in ups}) > 1 or len({layer.bias is None for layer in downs}) > 1:
            continue
        first, total = expert_range(module)
        module.native_experts = NativeExperts(list(ups), list(downs), ops, gate, first, total)
        count += 1
    return count
