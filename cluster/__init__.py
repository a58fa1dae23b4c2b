"""raydecode's driver: scheduler, engine, output processing and the Python clients.

Modules, one idea each:
  config            EngineConfig, the one validated configuration
  inputs            prompt shapes and chat rendering
  sequence          one sample of a request: tokens, text, logprobs, finish rules
  request           a request's n sequences and the outputs it shows (per output kind)
  detokenizer       incremental detokenization and stop strings for one sequence
  scheduler         continuous batching for one worker (rows, token and KV budgets)
  output_processor  a worker's reply merged into its sequences
  engine            LLMEngine: the loop over N Ray workers, fault tolerance
  llm, async_llm    the synchronous and the streaming client
  outputs           RequestOutput, CompletionOutput, RequestMetrics
"""

from cluster.async_llm import AsyncLLM
from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.llm import LLM
from cluster.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["LLM", "AsyncLLM", "LLMEngine", "EngineConfig", "RequestOutput", "CompletionOutput", "RequestMetrics"]
