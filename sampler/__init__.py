"""raydecode's sampler: pure torch + numpy, vectorised over the batch, no Ray.

Modules, one idea each:
  params            SamplingParams (the per-request knobs, validated, vLLM's names)
  config            SamplerConfig (the per-worker knobs)
  logprobs          Logprob, FlatLogprobs and helpers (driver-side containers)
  logits_processor/ the batch-level processor framework and its built-ins
  thinking_budget   ReasoningConfig and the holder that forces the end of a reasoning
                    block after a token budget
  metadata          SamplingMetadata: one batch's sampling parameters as tensors
  ops/              tensor kernels (penalties, top-k, top-k/top-p, bad words)
  positions         Positions: the batch row and draft prefix of each logits row
                    (speculative decoding)
  sampler           Sampler: the order of operations, top to bottom
  rejection_sampler RejectionSampler: verifying draft tokens
  demo              the sampler on its own, on a toy distribution
"""
