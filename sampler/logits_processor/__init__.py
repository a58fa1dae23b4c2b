"""The logits-processor framework (vLLM V1 compatible).

Modules, one idea each:
  interface  the contract: BatchUpdate, MoveDirectionality, LogitsProcessor and the
             error that names a failing processor
  state      BatchUpdateBuilder (a step's row changes) and LogitsProcessors (the set,
             split by argmax invariance)
  builtin    min-p, logit bias and min tokens, and process_dict_updates (per-row state
             that follows a BatchUpdate)
  adapter    AdapterLogitsProcessor: per-request callables as a batch-level processor
  loading    building the set (built-ins, entry points, configured classes) and
             checking a request's params against it
"""

from sampler.logits_processor.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from sampler.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    process_dict_updates,
)
from sampler.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorError,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from sampler.logits_processor.loading import (
    BUILTIN_LOGITS_PROCESSORS,
    LOGITSPROCS_GROUP,
    build_logitsprocs,
    load_class,
    validate_request_params,
)
from sampler.logits_processor.state import BatchUpdateBuilder, LogitsProcessors

__all__ = [
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BUILTIN_LOGITS_PROCESSORS",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LOGITSPROCS_GROUP",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessorError",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "build_logitsprocs",
    "load_class",
    "process_dict_updates",
    "validate_request_params",
]
