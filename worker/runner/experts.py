"""Mixture-of-experts layers as per-expert linear layers (which the CPU backend packs
and on-the-fly quantization quantizes), run through transformers' own experts interface.

transformers stores a layer's experts as 3D parameters (``gate_up_proj`` ``[experts,
2 x width, hidden]``, ``down_proj`` ``[experts, hidden, width]``, or transposed, with
optional biases) and dispatches their forward by ``config._experts_implementation``
(``ALL_EXPERTS_FUNCTIONS``: a Python loop, batched or grouped matmuls). Here each
expert becomes two ``nn.Linear`` (its rows of the 3D parameters, which are then
dropped), so the backend packs them like every other linear (column panels, or its
quantized kernel) and ``quantization`` int8/int4 quantizes them with the rest (the
loader unstacks first), and ``packed_experts_forward`` is registered as the
implementation:
the step's (token, expert) pairs sorted by expert, one matmul per expert over the
tokens routed to it (a loop over the experts that got tokens, never over tokens), the
family's own gate (``_apply_gate``: SiLU-and-multiply, gpt-oss's clamped one) between
the two, the routing weights, and each token's ``top_k`` outputs summed in a fixed
order. The router, the shared experts and the block around the experts stay the
family's own modules, so every family's routing (softmax or sigmoid top-k, its
normalisation, group-limited routing) is its own. A token's result does not depend on
which other tokens share its experts (each output row is computed alone by the packed
kernels, and the ``top_k`` sum runs in rank order): batch-invariant like the dense path.
A backend may give the module a ``native_experts`` callable doing the same in one call
(the CPU backend's: ``worker/cpu/moe_experts.py``), which then serves the steps it takes.
"""

from __future__ import annotations

import torch
from torch import nn

#: the name the packed experts are registered under in transformers' experts interface
EXPERTS_IMPLEMENTATION = "raydecode_packed"


def is_stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (the experts-interface
    decorator's flags) with its weights still stacked."""
    return (hasattr(module, "is_transposed") and hasattr(module, "has_gate") and hasattr(module, "num_experts")
            and isinstance(getattr(module, "down_proj", None), nn.Parameter))


def unstack_experts(model: nn.Module) -> int:
    """Every stacked experts module of ``model`` as per-expert linears
    (``expert_up``, ``expert_down``), its forward the packed one; the number of modules
    changed. Run before the backend packs the linears."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, packed_experts_forward)
    count = 0
    for module in list(model.modules()):
        if not is_stacked_experts(module):
            continue
        up_name = "gate_up_proj" if module.has_gate else "up_proj"
        module.expert_up = _linears(getattr(module, up_name), getattr(module, f"{up_name}_bias", None),
                                    module.is_transposed)
        module.expert_down = _linears(module.down_proj, getattr(module, "down_proj_bias", None), module.is_transposed)
        for name in (up_name, f"{up_name}_bias", "down_proj", "down_proj_bias"):
            if name in module._parameters:
                del module._parameters[name]  # read through the linears from now on
        module.config._experts_implementation = EXPERTS_IMPLEMENTATION
        count += 1
    return count


def _linears(stacked: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> nn.ModuleList:
    """One ``nn.Linear`` per expert over its slice of ``stacked`` (``[experts, out, in]``,
    or ``[experts, in, out]`` when ``transposed``)."""
    layers = []
    for e in range(stacked.shape[0]):
        weight = stacked[e].detach()
        weight = weight.t().contiguous() if transposed else weight
        out_features, in_features = weight.shape
        layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias[e].detach(), requires_grad=False)
        layers.append(layer)
    return nn.ModuleList(layers)


def hold_experts(module: nn.Module, first: int, total: int) -> None:
    """Marks an experts module as holding the experts ``first`` .. ``first +
    module.num_experts - 1`` of a layer's ``total`` (expert parallelism: each rank holds
    some of them whole); the forward skips the pairs routed to the others, which their
    ranks add in the all-reduce."""
    module.first_expert, module.total_experts = first, total


def expert_range(module: nn.Module) -> tuple[int, int]:
    """(first held expert, the layer's total; -1: the ones held)."""
    return int(getattr(module, "first_expert", 0)), int(getattr(module, "total_experts", -1))


def packed_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of one layer over ``hidden_states`` ``[T, hidden]``: token t goes to
    experts ``top_k_index[t]`` with weights ``top_k_weights[t]``; ``[T, hidden]``. A
    backend's one-call version (``native_experts``, the CPU kernels') serves the steps it
    takes."""
    native = getattr(self, "native_experts", None)
    if native is not None:
        out = native(hidden_states, top_k_index, top_k_weights)
        if out is not None:
            return out
    tokens, top_k = top_k_index.shape
    first, total = expert_range(self)
    expert_ids = top_k_index.reshape(-1) - first
    # the (token, rank) pairs by expert; under expert parallelism only those routed here
    order = torch.argsort(expert_ids, stable=True)
    if total >= 0:
        sorted_ids = expert_ids.index_select(0, order)
        order = order[(sorted_ids >= 0) & (sorted_ids < self.num_experts)]
    counts = torch.bincount(expert_ids.index_select(0, order), minlength=self.num_experts).tolist()
    picked = hidden_states.index_select(0, order // top_k)
    out = torch.empty(order.numel(), hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        rows = picked[start : start + n]
        up = self.expert_up[expert](rows)
        act = self._apply_gate(up) if self.has_gate else self.act_fn(up)
        out[start : start + n] = self.expert_down[expert](act.contiguous())
        start += n
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    # each token's top_k outputs summed in rank order (another rank's pairs: zeros)
    back = out.new_zeros(tokens * top_k, out.shape[-1]) if order.numel() < tokens * top_k else torch.empty_like(out)
    back[order] = out
    return back.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)
