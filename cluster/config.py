"""EngineConfig: everything the driver needs, in one validated configuration."""

from __future__ import annotations

from typing import Any

import msgspec

from cluster.reasoning_parsers import reasoning_parser
from worker.config import WorkerConfig, check_fraction, check_positive, is_int, require


class EngineConfig(WorkerConfig, kw_only=True):
    """Everything the engine needs: the worker's settings (``WorkerConfig``, inherited
    field for field) and the driver's below. Built from keywords (``LLM(**kwargs)``,
    the Serve YAML's ``engine:`` keys, the CLI's flags, which are generated from these
    fields and their ``#:`` comments), validated when built: a ``ValueError`` names the
    field."""

    #: Ray address; None: the running Ray of this process, else a new local one
    address: str | None = None
    #: data-parallel workers, each a whole model replica fed from one queue (one actor,
    #: or tensor_parallel_size x pipeline_parallel_size actors)
    num_workers: int = 1
    #: tokens per worker step (prefill chunks + decodes)
    max_num_batched_tokens: int = 512
    #: the longest prefill chunk one request may take in a step; None: the step budget
    long_prefill_token_threshold: int | None = None
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
    #: send steps and replies over a socket straight to each worker (the same messages,
    #: a fraction of a Ray call's round trip) instead of one Ray task call per step. Ray still places, probes, resets and replaces the workers; a worker
    #: whose channel cannot be opened gets Ray calls
    step_channel: bool = True
    #: "fcfs" or "priority" (lower value first, vLLM's convention)
    scheduling_policy: str = "fcfs"
    #: Ray CPUs per worker actor (per rank of a model-parallel worker). None: one CPU
    #: per worker, shared among its ranks (a scheduling token, not a thread cap: a
    #: second engine or a replacement worker always has room)
    worker_num_cpus: float | None = None
    #: Ray GPUs per worker actor (per rank). None: one GPU each when the cluster has GPUs
    worker_num_gpus: float | None = None
    #: how a model-parallel worker's ranks are placed (Ray placement group strategy):
    #: PACK (on one node where they fit), STRICT_PACK, SPREAD or STRICT_SPREAD
    placement_group_strategy: str = "PACK"
    #: custom resources each worker requires (places workers on the nodes that offer them)
    worker_resources: dict[str, float] = msgspec.field(default_factory=dict)
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
    #: how the model writes its reasoning (vLLM's names: deepseek_r1, qwen3, deepseek_v3,
    #: glm45, glm47, step3, seed_oss, mistral, granite, openai_gptoss): chat answers carry it apart from the content
    #: (``reasoning``), and a thinking budget counts between its markers unless
    #: reasoning_start / reasoning_end are given
    reasoning_parser: str | None = None
    #: extra keyword arguments for ``ray.init`` when the engine starts Ray
    ray_init_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            spec = reasoning_parser(self.reasoning_parser)
            if self.reasoning_start is None and self.reasoning_end is None:
                self.reasoning_start, self.reasoning_end = spec.budget_start, spec.budget_end
        super().__post_init__()
        check_positive(self, "num_workers", "max_num_batched_tokens", "max_request_failures", "max_n",
                       "max_sequences_per_request", "max_stop_strings")
        check_positive(self, "long_prefill_token_threshold", optional=True)
        for name in ("worker_start_timeout_s", "placement_report_s", "worker_restart_backoff_max_s",
                     "step_timeout_s", "ray_call_timeout_s", "no_worker_timeout_s"):
            value = getattr(self, name)
            require(not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0,
                    name, "a positive number of seconds", value)
        check_fraction(self, "cpu_kv_cache_fraction")
        require(is_int(self.prefix_routing_max_imbalance) and self.prefix_routing_max_imbalance >= 0,
                "prefix_routing_max_imbalance", "an int >= 0", self.prefix_routing_max_imbalance)
        require(self.placement_group_strategy in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"),
                "placement_group_strategy", "PACK, STRICT_PACK, SPREAD or STRICT_SPREAD", self.placement_group_strategy)
        require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "'fcfs' or 'priority'",
                self.scheduling_policy)
        require(self.async_scheduling is None or isinstance(self.async_scheduling, bool), "async_scheduling",
                "true, false or None", self.async_scheduling)
        if self.async_scheduling and self.spec_tokens:
            raise ValueError("async_scheduling cannot be combined with speculative decoding (num_spec_tokens or "
                             "speculative_config): the next step depends on the accepted drafts")
        for name in ("worker_num_cpus", "worker_num_gpus"):
            value = getattr(self, name)
            if value is not None:
                require(not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 0, name, ">= 0",
                        value)

    def async_scheduling_on(self, device: str) -> bool:
        """Whether the engine plans a step ahead for workers on ``device``
        (``async_scheduling`` resolved)."""
        if self.async_scheduling is None:
            return self.spec_tokens == 0 and not device.startswith("cpu")
        return self.async_scheduling

    def worker_config(self) -> WorkerConfig:
        """The worker's part of this configuration (what each worker is sent at load)."""
        return WorkerConfig(**{name: getattr(self, name) for name in WorkerConfig.__struct_fields__})
