"""Backend: what runs a step's forward on the runner's device.

The runner chooses one after loading the model (``choose_backend``): on CPU the
compiled kernels of ``worker/cpu/`` where they build and apply (the paged-attention
kernel, packed linears, the fused decoder); elsewhere, or with them off, the
device-agnostic torch paths (transformers' forward, attention by gathering blocks +
SDPA). A backend changes how fast a step runs, never what it computes beyond float
rounding: the torch paths are the reference every backend is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from worker.runner.attention_plan import AttentionPlan, PagedKernel
    from worker.runner.parallel_group import ParallelGroup
    from worker.config import WorkerConfig


class Decoder(Protocol):
    """Runs a model's decoder stack and LM head over one step's packed tokens in place
    of the transformers forward."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: AttentionPlan,
                logits_rows: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Backend:
    #: the paged kernel the attention plans carry; None: gather + SDPA
    attention_kernel: PagedKernel | None = None
    #: the forward in place of transformers'; None: the transformers forward
    decoder: Decoder | None = None
    #: linear layers swapped for packed ones
    num_packed_linear: int = 0


def choose_backend(model: nn.Module, device: torch.device, config: WorkerConfig,
                   group: ParallelGroup | None = None) -> Backend:
    """Prepares ``model`` for its device (this may repack its weights) and returns how
    its steps run: on CPU the CPU backend; elsewhere the transformers forward with
    attention through FlexAttention (``flex_attention``, on by default off the CPU) or
    the torch path. ``group``: the model is one rank's shard (the fused decoder reduces
    and gathers through it)."""
    backend = Backend()
    if device.type == "cpu":
        from worker.cpu.backend import prepare_cpu_backend

        backend = prepare_cpu_backend(model, config, group)
    flex = config.flex_attention if config.flex_attention is not None else device.type != "cpu"
    if flex:
        from worker.runner.flex_attention import FlexPagedAttention

        hf = model.config
        heads = hf.num_attention_heads
        backend.attention_kernel = FlexPagedAttention(heads, getattr(hf, "num_key_value_heads", None) or heads)
    return backend
