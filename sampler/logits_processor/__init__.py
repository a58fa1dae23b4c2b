"""The logits-processor framework (vLLM V1 compatible)."""

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
    MovedRequest,
    MoveDirectionality,
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
