"""raydecode's worker: the persistent batch, the transformers model runner, the Ray
worker actor, and the msgspec wire protocol the driver imports from here.

Modules, one idea each:
  protocol      the step message / reply Structs and their codec (the wire format)
  input_batch   InputBatch: per-row arrays following each BatchUpdate
  kv_cache      the per-row KV cache and the attention function registered with transformers
  cpu_linear    prepacked oneDNN linear layers for CPU inference
  model_loader  loading a causal LM (path, hub id, GGUF, the embedded default)
  ngram_proposer  prompt-lookup drafts for speculative decoding
  model_runner  ModelRunner: one step, one forward, sampling, the reply
  actor         the Ray actor (Worker, create_worker)
"""

from worker.protocol import (
    PROTOCOL_VERSION,
    AddedRequest,
    Codec,
    MovedRows,
    ProtocolError,
    StepReply,
    StepRequest,
    WorkerConfig,
    WorkerInfo,
)

__all__ = [
    "PROTOCOL_VERSION", "AddedRequest", "Codec", "MovedRows", "ProtocolError", "StepReply",
    "StepRequest", "WorkerConfig", "WorkerInfo",
]
