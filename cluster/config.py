"""EngineConfig: everything the driver needs, in one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.protocol import WorkerConfig


@dataclass
class EngineConfig:
    #: local path, hub id or .gguf file; None: the embedded SmolLM2-135M-Instruct
    model: str | None = None
    #: Ray address; None: the running Ray of this process, else a new local one
    address: str | None = None
    num_workers: int = 1
    #: rows per worker (the worker may allow fewer when its KV budget is smaller)
    max_num_seqs: int = 64
    #: tokens per worker step (prefill chunks + decodes)
    max_num_batched_tokens: int = 512
    #: the longest prefill chunk one request may take in a step; None: the step budget
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None
    #: per-worker KV budget in tokens, counted in blocks of ``kv_block_size``. Rows own
    #: full-length slots on the worker, so this is a policy limit: it bounds what the
    #: running requests may hold (on CPU, the memory actually touched). None: rows x
    #: max_model_len (nothing is ever preempted for KV).
    kv_cache_tokens: int | None = None
    kv_block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    #: swap rows so decodes precede prefill chunks in every step (vLLM's batch order
    #: for attention backends that want it; results are the same either way)
    decodes_first: bool = False
    #: "fcfs" or "priority" (lower value first, vLLM's convention)
    scheduling_policy: str = "fcfs"
    num_spec_tokens: int = 0
    max_logprobs: int = 20
    logits_processors: list[str] = field(default_factory=list)
    reasoning_start: str | None = None
    reasoning_end: str | None = None
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    #: Ray resources per worker actor; None: one GPU each when the cluster has GPUs,
    #: else an even share of the CPUs available when the engine starts
    worker_num_cpus: float | None = None
    worker_num_gpus: float | None = None
    #: custom resources each worker requires (places workers on the nodes that offer them)
    worker_resources: dict[str, float] = field(default_factory=dict)
    #: seconds a worker may take to be placed and load its model (at start: an error;
    #: a replacement for a dead worker: the engine serves on without it)
    worker_start_timeout_s: float = 300.0
    #: extra keyword arguments for ``ray.init`` when the engine starts Ray
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("num_workers", "max_num_seqs", "max_num_batched_tokens", "kv_block_size"):
            positive(name)
        for name in ("long_prefill_token_threshold", "max_model_len", "kv_cache_tokens"):
            if getattr(self, name) is not None:
                positive(name)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not isinstance(self.num_spec_tokens, int) or self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        for name in ("worker_num_cpus", "worker_num_gpus"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            model=self.model, device=self.device, dtype=self.dtype,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_spec_tokens=self.num_spec_tokens, max_logprobs=self.max_logprobs,
            logits_processors=list(self.logits_processors),
            reasoning_start=self.reasoning_start, reasoning_end=self.reasoning_end,
            seed=self.seed, trust_remote_code=self.trust_remote_code,
        )
