"""raydecode's sampler: pure torch + numpy, vectorised over the batch, no Ray.

Modules, one idea each:
  params            SamplingParams (the per-request knobs, validated)
  config            SamplerConfig (the per-worker knobs)
  logprobs          Logprob, FlatLogprobs and helpers (driver-side containers)
  logits_processor  the batch-level processor framework and its built-ins
  thinking_budget   forcing the end of a reasoning block after a token budget
  metadata          SamplingMetadata: one batch's sampling tensors
  ops/              tensor kernels (penalties, top-k/top-p, bad words)
  sampler           Sampler: the order of operations, top to bottom
  rejection_sampler RejectionSampler for speculative decoding
"""
