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
    #: data-parallel worker actors, each a whole model replica fed from one queue
    num_workers: int = 1
    #: rows per worker (the worker may allow fewer when its KV budget is smaller)
    max_num_seqs: int = 64
    #: tokens per worker step (prefill chunks + decodes)
    max_num_batched_tokens: int = 512
    #: the longest prefill chunk one request may take in a step; None: the step budget
    long_prefill_token_threshold: int | None = None
    #: longest prompt + output in tokens; None: the model's own limit
    max_model_len: int | None = None
    #: each worker's KV pool in tokens (a whole number of ``kv_block_size`` blocks);
    #: overrides the memory-based size. None: what the memory budget below holds, at
    #: most enough for every row at max_model_len
    kv_cache_tokens: int | None = None
    #: tokens per KV block (the unit of allocation and of prefix caching)
    kv_block_size: int = 16
    #: each worker's KV budget in bytes; None: on CUDA from gpu_memory_utilization, on
    #: CPU cpu_kv_cache_fraction of the node's RAM split among this engine's workers there
    kv_cache_memory_bytes: int | None = None
    #: CPU: commit every page of the KV pool when the worker loads (what vLLM's zeroed
    #: pool does) instead of as blocks are first used. Costs start time (about 1 s per
    #: GiB on this project's VMs) and the whole pool's RAM up front; spares the first
    #: requests the page faults (a few seconds over a 64-request run there)
    kv_cache_prefault: bool = False
    #: CUDA: the share of each GPU's memory a worker may use (model, activations, KV), as in vLLM
    gpu_memory_utilization: float = 0.9
    #: CPU: the share of a node's RAM this engine's workers on it give their KV pools
    cpu_kv_cache_fraction: float = 0.25
    #: reuse the KV of prompt prefixes computed before (automatic prefix caching)
    enable_prefix_caching: bool = True
    #: data parallel: a request goes to the worker holding the longest cached prefix of
    #: it, unless that worker holds at least this many more sequences than the one asking
    prefix_routing_max_imbalance: int = 8
    #: swap rows so decodes precede prefill chunks in every step (vLLM's batch order
    #: for attention backends that want it; results are the same either way)
    decodes_first: bool = False
    #: plan each worker's next decode step before the reply of the one it runs is
    #: merged, so the worker starts it at once instead of waiting a driver round trip
    #: (results are the same; a sequence that stops on EOS or a stop string may compute
    #: one token more, which is dropped). None: on for GPU workers without speculative
    #: decoding, off on CPU (as vLLM: there the driver's work would take the cores the
    #: forward runs on)
    async_scheduling: bool | None = None
    #: send steps and replies over a socket straight to each worker (the same messages;
    #: 0.05 ms a round trip against 1.4-3 ms for a Ray call here) instead of one Ray task
    #: call per step. Ray still places, probes, resets and replaces the workers; a worker
    #: whose channel cannot be opened gets Ray calls
    step_channel: bool = True
    #: "fcfs" or "priority" (lower value first, vLLM's convention)
    scheduling_policy: str = "fcfs"
    #: n-gram (prompt lookup) draft tokens per decode step for speculative decoding; 0: off
    num_spec_tokens: int = 0
    #: shortest n-gram the prompt-lookup proposer matches
    ngram_min: int = 1
    #: longest n-gram the prompt-lookup proposer matches
    ngram_max: int = 4
    #: the most logprobs / prompt_logprobs a request may ask per token; -1: no limit
    max_logprobs: int = 20
    #: what logprobs report: "raw_logprobs" (the model's, before any processing, as
    #: vLLM's default), "raw_logits", "processed_logprobs" or "processed_logits"
    logprobs_mode: str = "raw_logprobs"
    #: CPU: run linear layers with prepacked oneDNN weights (faster; off: plain F.linear)
    cpu_packed_linear: bool = True
    #: CPU, float32: linear layers over weights packed in column panels, our own kernel
    #: (faster than oneDNN's at decode sizes, within a few percent at prefill sizes; off:
    #: oneDNN's packed linear)
    cpu_panel_linear: bool = True
    #: CPU, float32, with cpu_panel_linear: linears called with at least this many rows
    #: (prefill chunks) run on a library GEMM's packed copy of their weights (MKL's
    #: sgemm where torch has MKL, else oneDNN's), ahead of the panels from ~110 rows on
    #: (the linears' weights then twice in memory, the LM head once); 0: panels at
    #: every size, one copy
    cpu_gemm_from_rows: int = 128
    #: CPU: decode attention with the compiled paged kernel (off: gather the blocks + SDPA)
    cpu_attention_kernel: bool = True
    #: CPU: Llama, Mistral and Qwen2 run with fused layer ops (off: the transformers forward)
    cpu_fused_decoder: bool = True
    #: custom logits processors, as "module:Qualname" (server configuration only)
    logits_processors: list[str] = field(default_factory=list)
    #: text of the token that opens a reasoning section (thinking_token_budget)
    reasoning_start: str | None = None
    #: text of the token that closes a reasoning section (thinking_token_budget)
    reasoning_end: str | None = None
    #: torch device of the workers ("cpu", "cuda", ...); None: cuda when a worker has a
    #: GPU, else cpu
    device: str | None = None
    #: model dtype: auto, float32, float16 or bfloat16; None (auto): float32 on CPU,
    #: bfloat16/float16 on CUDA
    dtype: str | None = None
    #: seed of the random stream that requests without a seed of their own draw from
    seed: int = 0
    #: let transformers run the model repository's own code
    trust_remote_code: bool = False
    #: Ray CPUs per worker actor. None: one CPU (a scheduling token, not a thread cap:
    #: a second engine or a replacement worker always has room)
    worker_num_cpus: float | None = None
    #: Ray GPUs per worker actor. None: one GPU each when the cluster has GPUs
    worker_num_gpus: float | None = None
    #: custom resources each worker requires (places workers on the nodes that offer them)
    worker_resources: dict[str, float] = field(default_factory=dict)
    #: torch threads per worker; None: ``worker_num_cpus`` when set (>= 1), else the
    #: cores of the worker's node split among this engine's workers on it
    worker_num_threads: int | None = None
    #: seconds a worker may take to be placed and load its model (at start: an error;
    #: a replacement: it is dropped and another one tried, with backoff)
    worker_start_timeout_s: float = 300.0
    #: a worker not placed after this many seconds is reported (log, health) with the
    #: resources it asks for and what the cluster has
    placement_report_s: float = 5.0
    #: longest pause between attempts to replace a worker that failed to start
    worker_restart_backoff_max_s: float = 30.0
    #: a step that takes longer means its worker hangs: it is killed and replaced, its
    #: requests re-queued
    step_timeout_s: float = 300.0
    #: every other call on a worker (fetching a reply, reset) gives up after this long
    ray_call_timeout_s: float = 60.0
    #: how long requests wait while no worker is alive before they fail (the health
    #: check fails too once there has been no live worker for this long)
    no_worker_timeout_s: float = 60.0
    #: a request whose step failed this many times (its worker died or raised with it
    #: in the batch) finishes with an error instead of being retried again
    max_request_failures: int = 3
    # -- bounds on one request (a ValueError / HTTP 400 beyond them) -------------------
    #: samples per prompt (``n``)
    max_n: int = 128
    #: prompts x n in one call of the HTTP API
    max_sequences_per_request: int = 1024
    #: entries of ``stop``, and of ``bad_words``
    max_stop_strings: int = 64
    #: extra keyword arguments for ``ray.init`` when the engine starts Ray
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("num_workers", "max_num_seqs", "max_num_batched_tokens", "kv_block_size",
                     "max_request_failures", "max_n", "max_sequences_per_request", "max_stop_strings"):
            positive(name)
        for name in ("long_prefill_token_threshold", "max_model_len", "kv_cache_tokens", "worker_num_threads"):
            if getattr(self, name) is not None:
                positive(name)
        for name in ("worker_start_timeout_s", "placement_report_s", "worker_restart_backoff_max_s",
                     "step_timeout_s", "ray_call_timeout_s", "no_worker_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("gpu_memory_utilization", "cpu_kv_cache_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if not isinstance(self.prefix_routing_max_imbalance, int) or self.prefix_routing_max_imbalance < 0:
            raise ValueError(f"prefix_routing_max_imbalance must be an int >= 0, got {self.prefix_routing_max_imbalance!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not isinstance(self.num_spec_tokens, int) or self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true, false or None, got {self.async_scheduling!r}")
        if self.async_scheduling and self.num_spec_tokens:
            raise ValueError("async_scheduling cannot be combined with num_spec_tokens > 0 "
                             "(speculative decoding): the next step depends on the accepted drafts")
        if self.cpu_gemm_from_rows < 0:
            raise ValueError(f"cpu_gemm_from_rows must be >= 0, got {self.cpu_gemm_from_rows}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        for name in ("ngram_min", "ngram_max"):
            positive(name)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        modes = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
        if self.logprobs_mode not in modes:
            raise ValueError(f"logprobs_mode must be one of {modes}, got {self.logprobs_mode!r}")
        for name in ("worker_num_cpus", "worker_num_gpus"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    def async_scheduling_on(self, device: str) -> bool:
        """Whether the engine plans a step ahead for workers on ``device``
        (``async_scheduling`` resolved)."""
        if self.async_scheduling is None:
            return self.num_spec_tokens == 0 and not device.startswith("cpu")
        return self.async_scheduling

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            model=self.model, device=self.device, dtype=self.dtype,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            kv_block_size=self.kv_block_size, kv_cache_tokens=self.kv_cache_tokens,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, kv_cache_prefault=self.kv_cache_prefault,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_spec_tokens=self.num_spec_tokens, ngram_min=self.ngram_min, ngram_max=self.ngram_max,
            max_logprobs=self.max_logprobs, logprobs_mode=self.logprobs_mode,
            cpu_packed_linear=self.cpu_packed_linear, cpu_panel_linear=self.cpu_panel_linear,
            cpu_gemm_from_rows=self.cpu_gemm_from_rows,
            cpu_attention_kernel=self.cpu_attention_kernel,
            cpu_fused_decoder=self.cpu_fused_decoder,
            logits_processors=list(self.logits_processors),
            reasoning_start=self.reasoning_start, reasoning_end=self.reasoning_end,
            seed=self.seed, trust_remote_code=self.trust_remote_code,
        )
