"""raydecode's driver: scheduler, engine, output processing and the Python clients.

Modules, one idea each:
  config            EngineConfig, the one validated configuration
  inputs            prompt shapes and chat rendering
  sequence          one sample of a request: tokens, text, logprobs, finish rules
  request           a request's n sequences and the outputs it shows (per output kind)
  detokenizer       incremental detokenization and stop strings for one sequence
  scheduler         continuous batching for one worker (rows, token and KV budgets)
  block_manager     one worker's KV blocks as the scheduler sees them (reference
                    counts, the prefix cache)
  output_processor  a worker's reply merged into its sequences
  input_processor   a request checked against the configuration and built, before
                    it is queued
  engine            LLMEngine: the step loop over N Ray workers
  step_stats        what the engine records of its steps (StepRecord, StepStats)
  supervision       the engine's watch over its workers: liveness probes, failed
                    steps, health
  worker_pool       the engine's worker actors, from placement to replacement
  placement         what a worker's ranks ask Ray for and where they go (bundles,
                    the Serve replica's reservation, the placement message)
  ray_session       an engine's hold on Ray, and stopping exactly what it started
  metrics           what the engine counts for monitoring (counters, histograms)
  lora              LoRARequest (vLLM's), and the adapters requests named, checked
  llm, async_llm    the synchronous and the streaming client
  outputs           RequestOutput, CompletionOutput, RequestMetrics
  pooling           pooling requests: PoolingParams, their outputs (embeddings,
                    classifications, scores) and the per-request finish of a vector
  demo              the embedded SmolLM2 answering chat prompts through LLM
"""

from cluster.async_llm import AsyncLLM
from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.llm import LLM
from cluster.lora import LoRARequest
from cluster.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cluster.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = ["LLM", "AsyncLLM", "LLMEngine", "EngineConfig", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "LoRARequest", "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput"]
