"""raydecode's worker. Its public surface, what the driver (``cluster/``) imports, is
this package and ``worker.transport``; the rooms behind it:

  transport/   how steps reach a worker: the Ray actor (``Worker``, ``create_worker``),
               its compute thread and the step channel (a socket beside Ray calls).
               The only room that imports Ray
  runner/      what a worker computes, on any device: ``ModelRunner`` (one step
               message in, one reply out), model loading, the persistent batch, the KV
               pool, the per-step attention plan and paged attention (the torch
               reference paths), the n-gram proposer, and the backend contract
  cpu/         the CPU backend: the C++ kernels (``csrc/``) and their loader, the
               paged-attention kernel's Python face, packed linears, the fused
               decoder, the shared-memory all-reduce
  gpu/         the GPU path: FlexAttention over the paged pool, CUDA graphs for decode
               steps, their host-built plans, compiled norms
  quant/       quantized weights kept quantized: their one form (``QuantizedWeight``),
               the readers of GGUF blocks and compressed-tensors checkpoints, int8/int4
               on the fly, the torch reference modules
  parallel/    model parallelism: a rank's layout, shard loading, the group's
               collectives and a rank's runner

and beside them, the floor every room (and the driver) stands on: ``config.py``
(``WorkerConfig``), ``protocol.py`` (the msgspec wire format both sides import),
``structured_output.py`` (grammars, which the driver also compiles to validate
requests), ``lora_adapter.py`` (PEFT adapter folders, which the driver also checks)
and ``cache.py`` (where built things are kept); ``build.py`` puts a runner
together for its device.

The import contracts (``pyproject.toml``, ``[tool.importlinter]``) keep this layering:
transport > build > parallel > cpu | gpu > runner > quant > the floor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.config import WorkerConfig
from worker.lora_adapter import LoRAAdapter, LoRAAdapterError, check_adapter_name, inspect_adapter
from worker.protocol import (
    PROTOCOL_VERSION,
    AddedRequest,
    Codec,
    GroupRank,
    Int32Array,
    MovedRows,
    ProtocolError,
    StepReply,
    StepRequest,
    StepTimings,
    WorkerInfo,
)

if TYPE_CHECKING:
    from worker.parallel.layout import leader_rank
    from worker.parallel.sharded_loader import check_model_parallel
    from worker.runner.model_loader import DEFAULT_MODEL_NAME, ModelLoadError, load_tokenizer
    from worker.structured_output import GrammarCompiler

__all__ = [
    "DEFAULT_MODEL_NAME", "PROTOCOL_VERSION", "AddedRequest", "Codec", "GrammarCompiler", "GroupRank",
    "Int32Array", "LoRAAdapter", "LoRAAdapterError", "ModelLoadError", "MovedRows", "ProtocolError", "StepReply", "StepRequest", "StepTimings",
    "WorkerConfig", "WorkerInfo", "check_adapter_name", "check_model_parallel", "inspect_adapter", "leader_rank", "load_tokenizer",
]


def __getattr__(name: str) -> Any:
    """The names that need transformers or llguidance load on first use, so importing
    ``worker`` stays cheap."""
    if name in ("DEFAULT_MODEL_NAME", "ModelLoadError", "load_tokenizer"):
        from worker.runner import model_loader

        return getattr(model_loader, name)
    if name == "GrammarCompiler":
        from worker.structured_output import GrammarCompiler

        return GrammarCompiler
    if name == "check_model_parallel":
        from worker.parallel.sharded_loader import check_model_parallel

        return check_model_parallel
    if name == "leader_rank":
        from worker.parallel.layout import leader_rank

        return leader_rank
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
