"""A worker's runner put together for its device: the backend chosen for the loaded
model (the CPU kernels, FlexAttention and CUDA graphs, or the torch reference paths)
and, for one rank of a model-parallel group, the rank's runner.

The choice sits above the backend rooms (``cpu/``, ``gpu/``) and the runner, which
knows only the contract (``worker/runner/backend.py``): the runner never imports a
backend, and a backend never decides for another.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch
from torch import nn

from worker.config import WorkerConfig
from worker.cpu.backend import prepare_cpu_backend
from worker.gpu.backend import add_flex_attention
from worker.parallel.sharded_runner import ShardedModelRunner
from worker.pooling import is_encoder
from worker.protocol import GroupRank
from worker.runner.backend import Backend
from worker.runner.model_loader import ModelLoadError
from worker.runner.model_runner import ModelRunner
from worker.runner.pooling_runner import PoolingModelRunner, serves_pooling

logger = logging.getLogger("raydecode")


def choose_backend(model: nn.Module, device: torch.device, config: WorkerConfig, group: Any = None) -> Backend:
    """Prepares ``model`` for its device (this may repack its weights) and returns how
    its steps run: on CPU the CPU backend; with FlexAttention (``flex_attention``, on
    by default off the CPU) its paged kernel, and CUDA graphs where they apply.
    ``group``: the model is one rank's shard (the fused decoder reduces and gathers
    through it)."""
    backend = prepare_cpu_backend(model, config, group) if device.type == "cpu" else Backend()
    flex = config.flex_attention if config.flex_attention is not None else device.type != "cpu"
    if flex:
        backend = add_flex_attention(backend, model, device, config, group)
    if config.cuda_graphs and backend.graphs is None:
        logger.warning("cuda_graphs needs FlexAttention (flex_attention not False): decode steps run eagerly")
    return backend


def choose_pooling_backend(model: nn.Module, device: torch.device, config: WorkerConfig, group: Any = None) -> Backend:
    """``choose_backend`` for a pooling model: an encoder's packed linears (its
    attention is the packed one: no paged kernel, FlexAttention or CUDA graphs);
    a decoder's the same as a generative model's, less the graphs (it never decodes)."""
    config = msgspec.structs.replace(config, cuda_graphs=False)
    if is_encoder(model.config):
        config = msgspec.structs.replace(config, flex_attention=False, cpu_attention_kernel=False,
                                         cpu_fused_decoder=False)
    return choose_backend(model, device, config, group)


def build_runner(config: WorkerConfig, group_rank: GroupRank | None = None, store: object | None = None) -> ModelRunner:
    """The runner of a worker with ``config``, on its device's backend. ``group_rank``:
    the worker is one rank of a model-parallel group (``config.group_size`` > 1): it
    loads its shard and joins the group's collectives (rank 0 through the rendezvous
    ``store`` it opened); only the leader samples."""
    if serves_pooling(config):
        if group_rank is not None:
            raise ModelLoadError("a pooling model runs in a single-rank worker (tensor_parallel_size and "
                                 "pipeline_parallel_size 1)")
        return PoolingModelRunner(config, choose_pooling_backend)
    if group_rank is None:
        return ModelRunner(config, choose_backend)
    return ShardedModelRunner(config, group_rank, store, choose_backend)
