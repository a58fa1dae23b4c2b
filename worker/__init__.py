"""raydecode's worker, in three rooms:

  transport/   how steps reach a worker: the Ray actor (``Worker``, ``create_worker``),
               its compute thread, the step channel (a socket beside Ray calls), and
               the msgspec wire protocol the driver imports (``protocol.py``)
  runner/      what a worker computes: ``ModelRunner`` (one step message in, one
               reply out), model loading, the persistent batch, the KV pool, the
               per-step attention plan and paged attention, structured outputs, the
               n-gram proposer, and the choice of backend
  cpu/         the CPU backend: the C++ kernels (``csrc/``) and their loader, the
               paged-attention kernel's Python face, packed linears, the fused decoder

``config.py`` beside them holds ``WorkerConfig``, the worker's part of the engine's
configuration. Only ``transport/`` imports Ray; the runner and the backend run in any
process (the tests drive them directly).
"""

from worker.config import WorkerConfig
from worker.transport.protocol import (
    PROTOCOL_VERSION,
    AddedRequest,
    Codec,
    MovedRows,
    ProtocolError,
    StepReply,
    StepRequest,
    WorkerInfo,
)

__all__ = [
    "PROTOCOL_VERSION", "AddedRequest", "Codec", "MovedRows", "ProtocolError", "StepReply",
    "StepRequest", "WorkerConfig", "WorkerInfo",
]
