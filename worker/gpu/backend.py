"""The GPU path put to work on a loaded model: attention through FlexAttention reading
the paged pool in place, and decode steps replayed from CUDA graphs with the model's
RMSNorms compiled inside them.

FlexAttention is on by default off the CPU (``flex_attention``); the graphs are on by
default on CUDA (``cuda_graphs``) for a whole model in one worker whose forward is
transformers' (no fused decoder, no model-parallel group). Off CUDA, graphs asked for
refill the same static inputs and run them eagerly, which is how the CPU tests check
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from worker.gpu.compiled_norms import CompiledNorms
from worker.gpu.cuda_graphs import DecodeGraphs
from worker.gpu.flex_attention import FlexPagedAttention
from worker.runner.backend import Backend, Forward
from worker.runner.kv_pool import kv_layout

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.runner.kv_pool import PagedKVCache


def add_flex_attention(backend: Backend, model: nn.Module, device: torch.device, config: WorkerConfig,
                       group: Any = None) -> Backend:
    """``backend`` with FlexAttention as its attention kernel and, where they apply,
    CUDA graphs for its decode steps."""
    hf = model.config
    # the pool's KV heads (one for multi-head latent attention and multi-query models)
    kernel = FlexPagedAttention(hf.num_attention_heads, kv_layout(hf, torch.float32).num_kv_heads)
    backend.attention_kernel = kernel
    wanted = config.cuda_graphs if config.cuda_graphs is not None else device.type == "cuda"
    if wanted and backend.decoder is None and group is None:
        backend.scratch_kv_blocks = 1  # a padding row decodes into it

        def graphs(forward: Forward, kv: PagedKVCache) -> DecodeGraphs:
            recorded = CompiledNorms(model).wrap(forward) if config.compiled_norms else None
            return DecodeGraphs(forward, kv, kernel, config.max_num_seqs, device, recorded)

        backend.graphs = graphs
    return backend
