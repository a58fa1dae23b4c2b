"""Backend: the contract between the runner and what runs a step's forward on a device.

The runner itself only knows the device-agnostic torch paths (transformers' forward,
attention by gathering blocks + SDPA): ``reference_backend``, what every other
backend is tested against. A faster backend is chosen above the runner, where a worker
is put together (``worker/build.py``), and handed to it as a ``ChooseBackend``: on CPU
the compiled kernels of ``worker/cpu/``; with FlexAttention (on by default off the
CPU) the paths of ``worker/gpu/``. A backend changes how fast a step runs, never what
it computes beyond float rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from worker.runner.attention import plan_in_effect

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.runner.attention_plan import AttentionPlan, PagedKernel
    from worker.runner.kv_pool import PagedKVCache

#: the runner's forward: one step's token ids ``[T]`` (at the plan's positions), the
#: plan, and the packed positions whose logits are wanted -> those logits (None on a
#: rank of a model-parallel group that does not hold them)
Forward = Callable[["torch.Tensor", "AttentionPlan", "torch.Tensor"], "torch.Tensor | None"]


class Decoder(Protocol):
    """Runs a model's decoder stack and LM head over one step's packed tokens in place
    of the transformers forward."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: AttentionPlan,
                logits_rows: torch.Tensor, hidden: torch.Tensor | None = None, head: bool = True) -> torch.Tensor:
        """The logits of the packed positions ``logits_rows`` (``head`` False: their
        hidden states after the final norm)."""


class StepGraphs(Protocol):
    """Recorded forwards that replay whole decode steps (CUDA graphs)."""

    def applies(self, num_rows: int, decode_only: bool) -> bool:
        """Whether a step of ``num_rows`` rows (``decode_only``: every row decodes one
        token, nothing else is asked) replays a recording."""

    def run(self, token_ids: np.ndarray, computed: np.ndarray, block_table: np.ndarray) -> torch.Tensor:
        """The step's logits, one row per step row."""


@dataclass
class Backend:
    #: the paged kernel the attention plans carry; None: gather + SDPA
    attention_kernel: PagedKernel | None = None
    #: the forward in place of transformers'; None: the transformers forward
    decoder: Decoder | None = None
    #: linear layers swapped for packed ones
    num_packed_linear: int = 0
    #: KV pool blocks set aside for the backend (the graphs' padding rows write there)
    scratch_kv_blocks: int = 0
    #: builds the backend's step graphs from the runner's forward and KV pool, once
    #: both exist; None: every step runs eagerly
    graphs: Callable[[Forward, PagedKVCache], StepGraphs] | None = None


#: how a runner gets its backend once its model is loaded: (model, device, config, the
#: model-parallel group when the model is one rank's shard) -> Backend. It may repack
#: the model's weights.
ChooseBackend = Callable[[nn.Module, torch.device, "WorkerConfig", Any], Backend]


def reference_backend(model: nn.Module, device: torch.device, config: WorkerConfig, group: Any = None) -> Backend:
    """The device-agnostic torch paths everywhere."""
    return Backend()


def forward_logits(model: nn.Module, decoder: Decoder | None, input_ids: torch.Tensor, plan: AttentionPlan,
                   keep: torch.Tensor) -> torch.Tensor:
    """The logits ``[len(keep), vocab]`` of the packed positions ``keep`` of one step's
    tokens ``input_ids`` (at the plan's positions): through the backend's ``decoder``
    when it has one, else transformers' forward with the paged attention."""
    if decoder is not None:
        return decoder.forward(input_ids, plan.token_positions, plan, keep)
    with plan_in_effect(plan):
        return model(
            input_ids=input_ids.unsqueeze(0), position_ids=plan.token_positions.unsqueeze(0),
            use_cache=False, logits_to_keep=keep, attention_plan=plan,
        ).logits[0]


def forward_hidden(model: nn.Module, decoder: Decoder | None, input_ids: torch.Tensor, plan: AttentionPlan,
                   keep: torch.Tensor) -> torch.Tensor:
    """The last hidden states ``[len(keep), hidden]`` (after the final norm) of the
    packed positions ``keep``: what a decoder used as a pooling model pools."""
    if decoder is not None:
        return decoder.forward(input_ids, plan.token_positions, plan, keep, head=False)
    base = getattr(model, model.base_model_prefix)
    with plan_in_effect(plan):
        out = base(input_ids=input_ids.unsqueeze(0), position_ids=plan.token_positions.unsqueeze(0),
                   use_cache=False, attention_plan=plan)
    return out.last_hidden_state[0].index_select(0, keep)
