"""Batch inference over Ray Datasets in Ray Data LLM's shape, raydecode's engine behind
it: a Ray Data LLM script runs by changing its import line from ``ray.data.llm`` to
``deploy.data``::

    from deploy.data import vLLMEngineProcessorConfig, build_processor

    processor = build_processor(
        vLLMEngineProcessorConfig(model_source=None, concurrency=2, batch_size=64),
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["text"]}],
                                    sampling_params=dict(temperature=0, max_tokens=32)),
        postprocess=lambda row: dict(answer=row["generated_text"], **row),
    )
    ds = processor(ray.data.read_json("prompts.jsonl"))

``model_source=None`` is the embedded SmolLM2. What differs from Ray's: see
``docs/usage.md`` ("Batch jobs over Ray Datasets").
"""

from deploy.data.config import (
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    PrepareMultimodalStageConfig,
    ProcessorConfig,
    TokenizerStageConfig,
    vLLMEngineProcessorConfig,
)
from deploy.data.processor import Processor, build_processor

__all__ = [
    "ChatTemplateStageConfig",
    "DetokenizeStageConfig",
    "PrepareMultimodalStageConfig",
    "Processor",
    "ProcessorConfig",
    "TokenizerStageConfig",
    "build_processor",
    "vLLMEngineProcessorConfig",
]
