"""vLLM's engine arguments in raydecode's terms: an ``LLMConfig``'s ``engine_kwargs``
become ``ServerArgs`` fields (vLLM's frontend names), ``EngineConfig`` fields (the
names the two share, a few renamed, raydecode's own) and the API key. An argument
raydecode cannot honour (vLLM-only, LoRA, prefill/decode disaggregation, a value only
vLLM takes) is a ``ValueError`` that names it and says why; the tables here list which
are which.
"""

from __future__ import annotations

from typing import Any

import msgspec

from cluster.config import EngineConfig
from deploy.server_args import StructuredOutputsConfig
from worker.speculative_config import parse_speculative_config

#: ``EngineConfig`` fields set from elsewhere in the config, never from engine_kwargs.
_SET_ELSEWHERE = {
    "model": "set model_loading_config.model_source instead (a hub id or a local path)",
    "served_model_name": "set model_loading_config.model_id instead (the name clients send)",
}

#: vLLM argument -> raydecode field of the same meaning under another name.
RENAMED = {
    "block_size": "kv_block_size",
    "data_parallel_size": "num_workers",
    "distributed_timeout_seconds": "distributed_timeout_s",
}

#: ``ServerArgs`` fields (the server's, not the engine's) that engine_kwargs may set:
#: vLLM's frontend names, and raydecode's data parallelism and tool bound.
SERVER_FIELDS = frozenset({"chat_template", "tool_call_parser", "enable_auto_tool_choice",
                           "exclude_tools_when_tool_choice_none", "structured_outputs_config", "num_workers",
                           "max_tools"})

#: vLLM arguments accepted when they ask for what raydecode always does.
ALWAYS = {
    "enable_chunked_prefill": (True, "raydecode always chunks prefills (max_num_batched_tokens per step)"),
    "distributed_executor_backend": ("ray", "raydecode's workers are always Ray actors"),
    "disable_log_stats": (False, "raydecode always keeps its engine stats (GET /metrics)"),
}

#: vLLM's LoRA arguments raydecode does not take (``enable_lora``, ``max_loras``,
#: ``max_lora_rank`` and ``max_cpu_loras`` are ``EngineConfig``'s own and pass through).
LORA_KWARGS = frozenset({
    "enable_lora_bias", "fully_sharded_loras",
    "lora_dtype", "lora_extra_vocab_size", "long_lora_scaling_factors", "lora_modules", "default_mm_loras",
    "lora_target_modules", "enable_tower_connector_lora", "specialize_active_lora", "qlora_adapter_name_or_path",
})

#: vLLM's arguments for moving KV between engines (prefill/decode disaggregation).
PD_KWARGS = frozenset({"kv_transfer_config", "ec_transfer_config"})

#: vLLM's engine (``AsyncEngineArgs``) and OpenAI frontend (``FrontendArgs``) arguments
#: that raydecode has no counterpart for, recent and older vLLM releases together.
VLLM_ONLY = frozenset({
    # engine: model and loading
    "enable_return_routed_experts", "model_weights", "hf_config_path", "convert", "task",
    "skip_tokenizer_init", "enable_prompt_embeds", "tokenizer_mode", "allowed_local_media_path",
    "allowed_media_domains", "download_dir", "safetensors_load_strategy", "load_format", "config_format",
    "revision", "code_revision", "hf_token", "hf_overrides", "tokenizer_revision",
    "allow_deprecated_quantization", "rope_scaling", "rope_theta", "generation_config",
    "override_generation_config", "model_impl", "override_attention_dtype", "model_loader_extra_config",
    "ignore_patterns", "use_tqdm_on_load", "pt_load_map_location", "max_parallel_loading_workers",
    "io_processor_plugin", "override_pooler_config", "override_neuron_config",
    "tokenizer_pool_size", "tokenizer_pool_type", "tokenizer_pool_extra_config", "worker_use_ray",
    "engine_use_ray",
    # engine: parallelism beyond tensor/pipeline/data
    "master_addr", "master_port", "nnodes", "node_rank", "numa_bind", "numa_bind_nodes", "numa_bind_cpus",
    "prefill_context_parallel_size", "decode_context_parallel_size", "dcp_comm_backend",
    "dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size", "data_parallel_rank",
    "data_parallel_start_rank", "data_parallel_size_local", "data_parallel_address", "data_parallel_rpc_port",
    "data_parallel_hybrid_lb", "data_parallel_external_lb", "data_parallel_backend",
    "enable_ep_weight_filter", "moe_backend", "all2all_backend", "enable_elastic_ep", "enable_dbo",
    "ubatch_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
    "disable_nccl_for_dp_synchronization", "eplb_config", "enable_eplb", "expert_placement_strategy",
    "disable_custom_all_reduce", "ray_workers_use_nsight", "worker_cls", "worker_extension_cls",
    # engine: KV cache, memory, scheduling
    "kv_cache_dtype", "calculate_kv_scales", "kv_cache_dtype_skip_layers", "prefix_caching_hash_algo",
    "disable_sliding_window", "disable_cascade_attn", "offload_backend", "cpu_offload_gb", "cpu_offload_params",
    "offload_group_size", "offload_num_in_group", "offload_prefetch_step", "offload_params", "swap_space",
    "num_gpu_blocks_override", "max_num_partial_prefills", "max_long_partial_prefills",
    "disable_chunked_mm_input", "scheduler_reserve_full_isl", "disable_hybrid_kv_cache_manager",
    "scheduler_cls", "kv_sharing_fast_prefill", "kv_offloading_size", "kv_offloading_backend",
    "kv_events_config", "use_v2_block_manager", "num_scheduler_steps", "multi_step_stream_outputs",
    "num_lookahead_slots", "preemption_mode", "scheduler_delay_factor", "stream_interval",
    "enable_sleep_mode", "shutdown_timeout", "weight_transfer_config",
    # engine: kernels and compilation
    "cudagraph_capture_sizes", "max_cudagraph_capture_size", "max_seq_len_to_capture", "ir_op_priority",
    "compilation_config", "attention_config", "attention_backend", "kernel_config",
    "enable_flashinfer_autotune", "optimization_level", "performance_mode", "gdn_prefill_backend",
    "disable_async_output_proc", "fail_on_environ_validation",
    # engine: state-space models
    "mamba_config", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_block_size", "mamba_cache_mode",
    "mamba_backend", "enable_mamba_cache_stochastic_rounding", "mamba_cache_philox_rounds",
    # engine: multimodal
    "language_model_only", "limit_mm_per_prompt", "enable_mm_embeds", "interleave_mm_strings",
    "media_io_kwargs", "mm_processor_kwargs", "mm_processor_cache_gb", "mm_processor_cache_type",
    "mm_shm_cache_max_object_size_mb", "mm_encoder_only", "mm_encoder_tp_mode", "mm_encoder_attn_backend",
    "mm_encoder_attn_dtype", "mm_encoder_fp8_scale_path", "mm_encoder_fp8_scale_save_path",
    "mm_encoder_fp8_scale_save_margin", "renderer_num_workers", "skip_mm_profiling", "video_pruning_rate",
    "mm_tensor_ipc", "disable_mm_preprocessor_cache",
    # engine: decoding, reasoning, speculative (other than n-gram), observability
    "reasoning_parser_plugin", "reasoning_config", "guided_decoding_backend",
    "logits_processor_pattern", "speculative_model", "num_speculative_tokens", "speculative_model_quantization",
    "speculative_draft_tensor_parallel_size", "speculative_max_model_len", "speculative_disable_by_batch_size",
    "ngram_prompt_lookup_max", "ngram_prompt_lookup_min", "enable_reasoning",
    "show_hidden_metrics_for_version", "otlp_traces_endpoint", "collect_detailed_traces", "kv_cache_metrics",
    "kv_cache_metrics_sample", "cudagraph_metrics", "enable_layerwise_nvtx_tracing", "enable_mfu_metrics",
    "enable_logging_iteration_details", "enable_mm_processor_stats", "aggregate_engine_logging",
    "profiler_config", "additional_config", "tokens_only", "enable_log_requests", "disable_log_requests",
    "enable_prompt_adapter", "max_prompt_adapters", "max_prompt_adapter_token",
    # frontend (the OpenAI server; Serve is raydecode's)
    "host", "port", "uds", "uvicorn_log_level", "disable_uvicorn_access_log", "allow_credentials",
    "allowed_origins", "allowed_methods", "allowed_headers", "chat_template_content_format",
    "trust_request_chat_template", "response_role", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
    "enable_ssl_refresh", "ssl_cert_reqs", "root_path", "middleware", "return_tokens_as_token_ids",
    "disable_frontend_multiprocessing", "enable_request_id_headers", "tool_parser_plugin", "tool_server",
    "log_config_file", "max_log_len", "disable_fastapi_docs", "enable_prompt_tokens_details",
    "enable_server_load_tracking", "enable_force_include_usage", "enable_tokenizer_info_endpoint",
    "enable_log_outputs", "h11_max_incomplete_event_size", "h11_max_header_count", "log_error_stack",
    "prompt_adapters",
})

#: vLLM dtype names -> ours.
_DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
           "float32": "float32"}


def _engine_fields() -> frozenset[str]:
    return frozenset(EngineConfig.__struct_fields__)


def _kwarg_error(name: str, why: str) -> ValueError:
    return ValueError(f"engine_kwargs.{name}: {why}")


def _speculative(spec: Any) -> dict[str, Any]:
    """vLLM's ``speculative_config``, checked here (n-gram and draft-model methods run;
    the rest are refused by name) and passed on as it is."""
    if not isinstance(spec, dict):
        raise _kwarg_error("speculative_config", f"expected a dict, got {type(spec).__name__}")
    try:
        parse_speculative_config(spec)
    except ValueError as exc:
        raise ValueError(f"engine_kwargs.{exc}") from None
    return dict(spec)


def map_engine_kwargs(kwargs: dict[str, Any], model: str) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """vLLM's ``engine_kwargs`` -> (``ServerArgs`` fields, ``EngineConfig`` fields, the
    API key). ``model``: the model source (a ``tokenizer`` must name the same).
    Raises ``ValueError`` naming the first argument raydecode cannot honour."""
    server: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    api_key: str | None = None
    ours = _engine_fields()

    def put(where: dict[str, Any], name: str, value: Any, given_as: str) -> None:
        if name in where:
            raise _kwarg_error(given_as, f"sets {name}, which another engine_kwargs entry sets too")
        where[name] = value

    for name, value in kwargs.items():
        if name in _SET_ELSEWHERE:
            raise _kwarg_error(name, _SET_ELSEWHERE[name])
        if name == "tokenizer":
            if value not in (None, model):
                raise _kwarg_error(name, "a tokenizer apart from the model is vLLM-only: raydecode loads the "
                                   "tokenizer saved with the model")
            continue
        if name == "api_key":
            keys = [value] if isinstance(value, str) else value
            if not (isinstance(keys, list) and len(keys) == 1 and isinstance(keys[0], str)):
                raise _kwarg_error(name, "raydecode's ingress takes one API key (a string)")
            api_key = keys[0]
            continue
        if name in LORA_KWARGS:
            if value in (None, False, "auto"):
                continue
            raise _kwarg_error(name, "not supported by raydecode's LoRA adapters (enable_lora, max_loras, "
                               "max_lora_rank and max_cpu_loras are)")
        if name in PD_KWARGS:
            raise _kwarg_error(name, "prefill/decode disaggregation (moving KV between engines) is not "
                               "supported by raydecode: each engine runs both prefill and decode")
        if name in ALWAYS:
            accepted, why = ALWAYS[name]
            if value in (accepted, None):
                continue
            raise _kwarg_error(name, f"only {accepted!r} is supported: {why}")
        if name == "enforce_eager":
            if value is not None:
                if not isinstance(value, bool):
                    raise _kwarg_error(name, f"expected true or false, got {value!r}")
                if value:  # False is vLLM's default, as graphs on CUDA workers are ours: nothing to set
                    put(engine, "cuda_graphs", False, name)
            continue
        if name == "speculative_config":
            if value is not None:
                put(engine, "speculative_config", _speculative(value), name)
            continue
        if name == "dtype" and value is not None:
            if value not in _DTYPES:
                raise _kwarg_error(name, f"expected one of {sorted(_DTYPES)}, got {value!r}")
            value = _DTYPES[value]
        if name == "long_prefill_token_threshold" and value == 0:
            value = None  # vLLM's 0: no threshold
        if name == "structured_outputs_config" and isinstance(value, dict):
            extra = sorted(set(value) - set(StructuredOutputsConfig.model_fields))
            if extra:
                raise _kwarg_error(name, f"{extra} are vLLM-only (raydecode's structured outputs take "
                                   f"{sorted(StructuredOutputsConfig.model_fields)})")
        target = RENAMED.get(name, name)
        if target in SERVER_FIELDS:
            put(server, target, value, name)
        elif target in ours:
            if value is not None:  # None: vLLM's "the default"
                put(engine, target, value, name)
        elif name in VLLM_ONLY:
            raise _kwarg_error(name, "a vLLM argument with no raydecode counterpart (vLLM-only); remove it "
                               "(deploy/README.md lists the engine_kwargs raydecode takes)")
        else:
            raise _kwarg_error(name, "unknown engine argument: neither one of vLLM's nor one of raydecode's "
                               "(cluster.config.EngineConfig)")
    check_engine_types(engine, server.get("num_workers", 1))
    return server, engine, api_key


def check_engine_types(engine: dict[str, Any], num_workers: Any) -> None:
    """``EngineConfig``'s own checks, with the types enforced (an engine built from
    keywords does not check them all): the ``ValueError`` names the field."""
    try:
        msgspec.convert({**engine, "num_workers": num_workers}, EngineConfig)
    except msgspec.ValidationError as exc:
        where = str(exc).rsplit("at `$.", 1)
        name = where[1].rstrip("`") if len(where) == 2 else ""
        raise ValueError(f"engine_kwargs.{name}: {where[0].removesuffix(' - ')}" if name
                         else f"engine_kwargs: {exc}") from None

