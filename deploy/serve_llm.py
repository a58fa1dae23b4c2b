"""Ray Serve LLM's configuration shape on raydecode: ``LLMConfig``, ``LLMServingArgs``,
``build_llm_deployment`` and ``build_openai_app`` with Ray's field names, so a Ray Serve
LLM application runs here by changing its ``import_path`` from
``ray.serve.llm:build_openai_app`` to ``deploy.serve_llm:build_openai_app`` (or, in
Python, the import) and nothing else.

Each ``LLMConfig`` becomes one engine deployment (``deploy.serve.engine_deployment``,
named ``LLMEngine:<model_id>``) and one OpenAI ingress (``deploy.ingress``) routes every
request to the engine named by its ``model``, as Ray Serve LLM's ``OpenAiIngress``
does. The fields map to ``ServerArgs`` / ``EngineConfig``:

* ``model_loading_config``: ``model_id`` is the name clients send (``served_model_name``),
  ``model_source`` a hub id or a local path (``model``; None: ``model_id`` as a hub id).
* ``engine_kwargs``: vLLM's engine and frontend argument names that raydecode shares pass
  through (``max_model_len``, ``max_num_seqs``, ``tensor_parallel_size``, ...), a few are
  renamed (``block_size`` -> ``kv_block_size``, ``data_parallel_size`` -> ``num_workers``,
  an n-gram ``speculative_config`` -> ``num_spec_tokens``/``ngram_*``, ...), raydecode's
  own ``EngineConfig`` names are accepted too; a vLLM-only argument, LoRA or prefill/decode
  disaggregation is a ``ValueError`` that names the argument and says why.
* ``deployment_config``: the engine deployment's Serve options (replicas or
  ``autoscaling_config``, queue bounds, drain time, ``ray_actor_options``, health checks,
  ``request_router_config``: Ray's ``PrefixCacheAffinityRouter`` becomes raydecode's
  prefix-aware router with the same ``request_router_kwargs``; left out, the engine's
  default applies: prefix-aware routing).
* ``accelerator_type``: every worker requires Ray's ``accelerator_type:<T>`` resource;
  building fails when no node of the running cluster has it and no autoscaler could add one.
* ``runtime_env``: the engine replicas' and their workers' runtime_env.
* ``placement_group_config``: ``bundle_per_worker`` -> each rank's CPUs, GPUs and custom
  resources; ``strategy`` -> ``placement_group_strategy``.

The mapping is done (and checked) when an ``LLMConfig`` is built, without Ray; only the
``accelerator_type`` check against the cluster needs a running Ray (it is skipped where
none is initialised). Nothing here imports ``ray.serve.llm`` (which needs vLLM).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import ray
import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator, model_validator
from ray import serve

from cluster.config import EngineConfig
from deploy.request_router import from_ray_serve_llm
from deploy.serve import engine_deployment, ingress_deployment
from deploy.server_args import ServerArgs, StructuredOutputsConfig

logger = logging.getLogger("ray.serve")

#: Ray Serve LLM names each engine deployment ``LLMServer:<model_id>``; ours are engines.
DEPLOYMENT_PREFIX = "LLMEngine:"

# -- engine_kwargs ------------------------------------------------------------------------

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

#: vLLM's LoRA arguments (``enable_lora: false`` alone is accepted).
LORA_KWARGS = frozenset({
    "enable_lora", "enable_lora_bias", "max_loras", "max_lora_rank", "max_cpu_loras", "fully_sharded_loras",
    "lora_dtype", "lora_extra_vocab_size", "long_lora_scaling_factors", "lora_modules", "default_mm_loras",
    "lora_target_modules", "enable_tower_connector_lora", "specialize_active_lora", "qlora_adapter_name_or_path",
})

#: vLLM's arguments for moving KV between engines (prefill/decode disaggregation).
PD_KWARGS = frozenset({"kv_transfer_config", "ec_transfer_config"})

#: vLLM's engine (``AsyncEngineArgs``) and OpenAI frontend (``FrontendArgs``) arguments
#: that raydecode has no counterpart for, recent and older vLLM releases together.
VLLM_ONLY = frozenset({
    # engine: model and loading
    "enable_return_routed_experts", "model_weights", "hf_config_path", "runner", "convert", "task",
    "skip_tokenizer_init", "enable_prompt_embeds", "tokenizer_mode", "allowed_local_media_path",
    "allowed_media_domains", "download_dir", "safetensors_load_strategy", "load_format", "config_format",
    "revision", "code_revision", "hf_token", "hf_overrides", "tokenizer_revision", "quantization",
    "quantization_config", "allow_deprecated_quantization", "rope_scaling", "rope_theta", "generation_config",
    "override_generation_config", "model_impl", "override_attention_dtype", "model_loader_extra_config",
    "ignore_patterns", "use_tqdm_on_load", "pt_load_map_location", "max_parallel_loading_workers",
    "io_processor_plugin", "pooler_config", "override_pooler_config", "override_neuron_config",
    "tokenizer_pool_size", "tokenizer_pool_type", "tokenizer_pool_extra_config", "worker_use_ray",
    "engine_use_ray",
    # engine: parallelism beyond tensor/pipeline/data
    "master_addr", "master_port", "nnodes", "node_rank", "numa_bind", "numa_bind_nodes", "numa_bind_cpus",
    "prefill_context_parallel_size", "decode_context_parallel_size", "dcp_comm_backend",
    "dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size", "data_parallel_rank",
    "data_parallel_start_rank", "data_parallel_size_local", "data_parallel_address", "data_parallel_rpc_port",
    "data_parallel_hybrid_lb", "data_parallel_external_lb", "data_parallel_backend", "enable_expert_parallel",
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
    "reasoning_parser", "reasoning_parser_plugin", "reasoning_config", "guided_decoding_backend",
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

_REMOTE_PREFIXES = ("s3://", "gs://", "abfss://", "azure://", "pyarrow-")


def _engine_fields() -> frozenset[str]:
    return frozenset(EngineConfig.__struct_fields__)


def _kwarg_error(name: str, why: str) -> ValueError:
    return ValueError(f"engine_kwargs.{name}: {why}")


def _speculative(spec: Any) -> dict[str, Any]:
    """vLLM's ``speculative_config`` -> ours: only n-gram prompt lookup exists here."""
    if not isinstance(spec, dict):
        raise _kwarg_error("speculative_config", f"expected a dict, got {type(spec).__name__}")
    method = spec.get("method")
    if method not in ("ngram", "[ngram]"):
        raise _kwarg_error("speculative_config", f"method {method!r} is vLLM-only: raydecode's speculative "
                           "decoding is n-gram prompt lookup (method: ngram)")
    names = {"num_speculative_tokens": "num_spec_tokens", "prompt_lookup_min": "ngram_min",
             "prompt_lookup_max": "ngram_max"}
    other = sorted(set(spec) - set(names) - {"method"})
    if other:
        raise _kwarg_error("speculative_config", f"{other} are vLLM-only (raydecode's n-gram drafts take "
                           "num_speculative_tokens, prompt_lookup_min and prompt_lookup_max)")
    if "num_speculative_tokens" not in spec:
        raise _kwarg_error("speculative_config", "num_speculative_tokens is required")
    return {ours: spec[theirs] for theirs, ours in names.items() if theirs in spec}


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
            if name == "enable_lora" and value is False:
                continue
            raise _kwarg_error(name, "LoRA adapters are not supported by raydecode (no adapter loading or "
                               "multiplexing); serve a model with the adapter merged into its weights")
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
                for key, v in _speculative(value).items():
                    put(engine, key, v, name)
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
    _check_engine_types(engine, server.get("num_workers", 1))
    return server, engine, api_key


def _check_engine_types(engine: dict[str, Any], num_workers: Any) -> None:
    """``EngineConfig``'s own checks, with the types enforced (an engine built from
    keywords does not check them all): the ``ValueError`` names the field."""
    try:
        msgspec.convert({**engine, "num_workers": num_workers}, EngineConfig)
    except msgspec.ValidationError as exc:
        where = str(exc).rsplit("at `$.", 1)
        name = where[1].rstrip("`") if len(where) == 2 else ""
        raise ValueError(f"engine_kwargs.{name}: {where[0].removesuffix(' - ')}" if name
                         else f"engine_kwargs: {exc}") from None


# -- deployment_config ----------------------------------------------------------------

#: The ``deployment_config`` keys Ray Serve LLM documents.
DEPLOYMENT_KEYS = ("name", "num_replicas", "ray_actor_options", "max_ongoing_requests", "autoscaling_config",
                   "max_queued_requests", "user_config", "health_check_period_s", "health_check_timeout_s",
                   "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s", "logging_config",
                   "request_router_config")
#: Of these, the ones handed to Serve as they are.
_PASSED_TO_SERVE = ("health_check_period_s", "health_check_timeout_s", "graceful_shutdown_wait_loop_s",
                    "logging_config", "request_router_config")


def _serve_checked(where: str, options: dict[str, Any]) -> None:
    """Serve's own validation of deployment options (types, ranges, num_replicas "auto")."""
    from ray.serve._private.config import DeploymentConfig, handle_num_replicas_auto

    values = {k: v for k, v in options.items() if k not in ("name", "ray_actor_options")}
    try:
        if values.get("num_replicas") == "auto":
            _, autoscaling = handle_num_replicas_auto(values.get("max_ongoing_requests"),
                                                      values.get("autoscaling_config"))
            values = {**values, "num_replicas": None, "autoscaling_config": autoscaling}
        DeploymentConfig(**values)
    except ValidationError as exc:  # the first error, on one line, under the option's name
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(f"{where}.{loc}: {first['msg']} (got {first.get('input')!r})" if loc
                         else f"{where}: {first['msg']}") from None
    except Exception as exc:
        raise ValueError(f"{where}: {exc}") from None
    actor = options.get("ray_actor_options")
    if actor is not None and not isinstance(actor, dict):
        raise ValueError(f"{where}.ray_actor_options: expected a dict, got {type(actor).__name__}")


def map_deployment_config(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Ray Serve LLM's ``deployment_config`` -> (``ServerArgs`` fields, the replicas'
    ``ray_actor_options``, further Serve options)."""
    if "placement_group_bundles" in config or "placement_group_strategy" in config:
        raise ValueError("deployment_config: placement_group_bundles and placement_group_strategy must not be "
                         "specified in deployment_config (as in Ray Serve LLM): use placement_group_config")
    unknown = sorted(set(config) - set(DEPLOYMENT_KEYS))
    if unknown:
        raise ValueError(f"deployment_config.{unknown[0]}: not a deployment option (supported: "
                         f"{', '.join(DEPLOYMENT_KEYS)})")
    if config.get("user_config") is not None:
        raise ValueError("deployment_config.user_config: not supported: raydecode's engine deployment has no "
                         "reconfigure(); change engine settings in engine_kwargs (a redeploy)")
    if config.get("request_router_config") is not None:
        # Ray's prefix-aware router cannot read our requests (and importing it needs
        # pyarrow): ours, with its keyword arguments. Before Serve's check, which imports it.
        config = {**config, "request_router_config": from_ray_serve_llm(config["request_router_config"])}
    _serve_checked("deployment_config", config)
    server: dict[str, Any] = {}
    replicas, autoscaling = config.get("num_replicas"), config.get("autoscaling_config")
    if autoscaling is not None and not isinstance(autoscaling, dict):
        autoscaling = autoscaling.model_dump(exclude_unset=True)  # an AutoscalingConfig
    if replicas == "auto":
        from ray.serve._private.config import handle_num_replicas_auto

        _, resolved = handle_num_replicas_auto(config.get("max_ongoing_requests"), autoscaling)
        server["autoscaling_config"] = resolved.model_dump(exclude_unset=True)
    elif replicas is not None and autoscaling is not None:
        raise ValueError("deployment_config: num_replicas and autoscaling_config together: give one "
                         "(num_replicas: auto autoscales with Serve's defaults)")
    elif replicas is not None:
        server["num_replicas"] = replicas
    elif autoscaling is not None:
        server["autoscaling_config"] = autoscaling
    for key in ("max_ongoing_requests", "max_queued_requests", "graceful_shutdown_timeout_s"):
        if config.get(key) is not None:
            server[key] = config[key]
    actor = dict(config.get("ray_actor_options") or {})
    serve_options = {k: config[k] for k in _PASSED_TO_SERVE if config.get(k) is not None}
    return server, actor, serve_options


# -- accelerators -----------------------------------------------------------------------

def accelerator_types() -> list[str]:
    """The accelerator names Ray knows (``ray.util.accelerators``), as Ray Serve LLM
    accepts them."""
    import ray.util.accelerators.accelerators as known

    return [v for k, v in vars(known).items() if not k.startswith("_") and isinstance(v, str)]


def accelerator_resource(accelerator_type: str) -> str:
    """Ray's resource that nodes with ``accelerator_type`` offer."""
    return f"accelerator_type:{accelerator_type}"


def missing_accelerator(accelerator_type: str, cluster: dict[str, float],
                        could_add: dict[str, float] | None) -> str | None:
    """Why no node could offer ``accelerator_type``, or None when one can: ``cluster``
    is the running cluster's resources, ``could_add`` what its autoscaler can add ({}:
    no autoscaler; None: one runs but does not say, so any type could come)."""
    resource = accelerator_resource(accelerator_type)
    if cluster.get(resource, 0) > 0 or could_add is None or could_add.get(resource, 0) > 0:
        return None
    present = sorted(k.split(":", 1)[1] for k in {**cluster, **could_add} if k.startswith("accelerator_type:"))
    return (f"accelerator_type {accelerator_type!r}: no node of this Ray cluster has it (resource "
            f"{resource!r}) and no autoscaler could add one; the cluster's accelerator types: "
            f"{', '.join(present) or 'none'}")


def _autoscaler_resources() -> dict[str, float] | None:
    """The most of each resource the cluster's autoscaler could bring: what it
    publishes (autoscaler v2, KubeRay), {} where the head runs Ray's read-only monitor
    (a cluster without an autoscaling config: its nodes are all there is), None where
    that cannot be told (an autoscaler v1 with node types of its own, or no report yet)."""
    try:
        from ray._private import state
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.autoscaler._private.util import format_readonly_node_type
        from ray.experimental.internal_kv import _internal_kv_get

        most = state.state.get_max_resources_from_cluster_config()
        if most:
            return dict(most)
        status = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
        if not status:
            return None
        mapping = (json.loads(status).get("autoscaler_report") or {}).get("node_type_mapping") or {}
        if mapping and all(kind == format_readonly_node_type(node) for node, kind in mapping.items()):
            return {}
        return None
    except Exception:  # Ray's private API moved: assume an autoscaler could add it
        return None


def check_accelerator(accelerator_type: str) -> None:
    """Fails when the running Ray cluster cannot have a node with ``accelerator_type``
    (no-op where Ray is not initialised: the deployment would wait for such a node)."""
    if not ray.is_initialized():
        return
    why = missing_accelerator(accelerator_type, ray.cluster_resources(), _autoscaler_resources())
    if why is not None:
        raise ValueError(why)


# -- the configuration ----------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelLoadingConfig(_Strict):
    """Which model, under which name (Ray Serve LLM's ``ModelLoadingConfig``)."""

    #: the name clients send as ``model``
    model_id: str
    #: a hub id or a local path; None: ``model_id`` as a hub id. Ray's cloud mirrors
    #: (``{bucket_uri: s3://...}``) are not supported
    model_source: str | dict[str, Any] | None = None
    #: must be None or the model source: the tokenizer is the one saved with the model
    tokenizer_source: str | None = None

    @model_validator(mode="after")
    def _sources(self) -> ModelLoadingConfig:
        if not self.model_id:
            raise ValueError("model_id: must not be empty")
        source = self.model_source
        if isinstance(source, dict) or (isinstance(source, str) and source.startswith(_REMOTE_PREFIXES)):
            raise ValueError(f"model_source: cloud storage mirrors ({source!r}) are not supported by raydecode: "
                             "give a hub id or a local path (download the weights first)")
        if self.tokenizer_source not in (None, self.model()):
            raise ValueError("tokenizer_source: a tokenizer apart from the model is not supported: raydecode "
                             "loads the tokenizer saved with the model")
        return self

    def model(self) -> str:
        """What raydecode loads: ``model_source``, else ``model_id``."""
        return self.model_source if isinstance(self.model_source, str) else self.model_id


class AcceleratorConfig(_Strict):
    """Ray Serve LLM's ``accelerator_config`` (its ``kind``)."""

    kind: Literal["cpu", "gpu", "tpu"]
    topology: str | None = None


@dataclass(frozen=True)
class EnginePlan:
    """One ``LLMConfig`` in raydecode's terms: the engine deployment's arguments and
    options."""

    args: ServerArgs
    #: the deployment's name, without the prefix
    name: str
    #: ``ray_actor_options`` of the engine replicas (their runtime_env is in ``args``)
    actor_options: dict[str, Any] = field(default_factory=dict)
    #: further Serve options (health checks, logging, request router)
    serve_options: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    accelerator_type: str | None = None


class LLMConfig(_Strict):
    """One model's deployment, with Ray Serve LLM's field names (see the module doc for
    how each maps). Built (and checked) without Ray."""

    model_loading_config: ModelLoadingConfig
    runtime_env: dict[str, Any] | None = None
    #: Ray Serve LLM's only value; raydecode's engine stands in for vLLM
    llm_engine: str = "vLLM"
    engine_kwargs: dict[str, Any] = {}
    accelerator_type: str | None = None
    accelerator_config: AcceleratorConfig | None = None
    placement_group_config: dict[str, Any] | None = None
    #: refused: raydecode serves no LoRA adapters
    lora_config: dict[str, Any] | None = None
    deployment_config: dict[str, Any] = {}
    #: refused when set: the engine deployment is raydecode's EngineServer
    server_cls: Any = None
    experimental_configs: dict[str, Any] = {}
    #: accepted; raydecode's engine metrics are always on (GET /metrics)
    log_engine_metrics: bool | None = True
    #: refused unless empty: raydecode has no model-loading callbacks
    callback_config: dict[str, Any] | None = None

    _plan: EnginePlan | None = PrivateAttr(default=None)

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    @field_validator("llm_engine")
    @classmethod
    def _engine(cls, value: str) -> str:
        if value != "vLLM":
            raise ValueError(f"Unsupported engine: {value} (Ray Serve LLM's only engine is vLLM, which raydecode "
                             "stands in for)")
        return value

    @field_validator("accelerator_type")
    @classmethod
    def _accelerator(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = "A10G" if value == "A10" else value  # as Ray Serve LLM
        known = accelerator_types()
        if value not in known:
            raise ValueError(f"Unsupported accelerator type: {value} (Ray's accelerator types: {', '.join(known)})")
        if value.startswith("TPU-"):
            raise ValueError(f"accelerator_type {value}: TPUs are not supported by raydecode (CUDA GPUs or CPUs)")
        return value

    @model_validator(mode="after")
    def _mapped(self) -> LLMConfig:
        self._plan = self._make_plan()
        return self

    def plan(self) -> EnginePlan:
        """This config in raydecode's terms (``ValueError`` where it cannot be)."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> EnginePlan:
        if self.lora_config is not None:
            raise ValueError("lora_config: LoRA adapters are not supported by raydecode (no adapter loading or "
                             "multiplexing); serve a model with the adapter merged into its weights")
        if self.server_cls is not None:
            raise ValueError("server_cls: not supported: raydecode's engine deployment is "
                             "deploy.engine_server.EngineServer")
        if self.callback_config and (self.callback_config.get("callback_class")
                                     or self.callback_config.get("callback_kwargs")):
            raise ValueError("callback_config: model-loading callbacks are not supported by raydecode")
        experimental = sorted(set(self.experimental_configs) - {"num_ingress_replicas", "stream_batching_interval_ms"})
        if experimental:
            raise ValueError(f"experimental_configs.{experimental[0]}: not supported by raydecode (supported: "
                             "num_ingress_replicas, stream_batching_interval_ms)")
        if "stream_batching_interval_ms" in self.experimental_configs:
            logger.info("experimental_configs.stream_batching_interval_ms has no effect on raydecode: a stream "
                        "sends what each engine step produced, joined while the reader is busy")
        if self.log_engine_metrics is False:
            logger.info("log_engine_metrics: false has no effect on raydecode: GET /metrics always has them")
        model = self.model_loading_config.model()
        server, engine, api_key = map_engine_kwargs(self.engine_kwargs, model)
        self._placement(engine)
        deployment_server, actor, serve_options = map_deployment_config(self.deployment_config)
        runtime_env = {**(actor.pop("runtime_env", None) or {}), **(self.runtime_env or {})}
        args = ServerArgs.model_validate({
            "model": model, "served_model_name": self.model_id, **server, **deployment_server, "engine": engine,
            "runtime_env": runtime_env or None,
        })
        name = self.deployment_config.get("name") or self.model_id.replace("/", "--").replace(".", "_")
        return EnginePlan(args=args, name=name, actor_options=actor, serve_options=serve_options,
                          api_key=api_key, accelerator_type=self.accelerator_type)

    def _placement(self, engine: dict[str, Any]) -> None:
        """``accelerator_type``, ``accelerator_config`` and ``placement_group_config``
        onto the engine's worker resources (in place)."""
        def put(name: str, value: Any, given_as: str) -> None:
            if name in engine and engine[name] != value:
                raise ValueError(f"{given_as}: sets {name}, which engine_kwargs sets to {engine[name]!r}")
            engine[name] = value

        resources = dict(engine.get("worker_resources") or {})
        pg = self.placement_group_config
        if pg is not None:
            unknown = sorted(set(pg) - {"bundle_per_worker", "bundles", "strategy"})
            if unknown:
                raise ValueError(f"placement_group_config.{unknown[0]}: not a placement_group_config key "
                                 "(bundle_per_worker, strategy)")
            if pg.get("bundles") is not None:
                raise ValueError("placement_group_config.bundles: not supported: raydecode places one bundle per "
                                 "worker rank itself; give bundle_per_worker (and strategy)")
            if pg.get("strategy") is not None:
                put("placement_group_strategy", pg["strategy"], "placement_group_config.strategy")
            bundle = pg.get("bundle_per_worker") or {}
            if not isinstance(bundle, dict):
                raise ValueError("placement_group_config.bundle_per_worker: expected a dict of resources")
            for key, amount in bundle.items():
                where = f"placement_group_config.bundle_per_worker.{key}"
                if key == "CPU":
                    put("worker_num_cpus", amount, where)
                elif key == "GPU":
                    put("worker_num_gpus", amount, where)
                elif key == "TPU":
                    raise ValueError(f"{where}: TPUs are not supported by raydecode")
                elif key == "memory":
                    raise ValueError(f"{where}: not supported (worker memory is not reserved through Ray)")
                else:
                    resources[key] = amount
        kind = self.accelerator_config.kind if self.accelerator_config is not None else None
        if kind == "tpu":
            raise ValueError("accelerator_config: TPUs are not supported by raydecode")
        if kind == "cpu":
            if self.accelerator_type is not None:
                raise ValueError(f"accelerator_type={self.accelerator_type!r} cannot be used with CPU-only "
                                 "configurations (accelerator_config kind cpu)")
            put("device", "cpu", "accelerator_config.kind")
            engine.setdefault("worker_num_gpus", 0)
        if self.accelerator_type is not None:
            resources[accelerator_resource(self.accelerator_type)] = 0.001  # Ray Serve LLM's amount
        if resources:
            engine["worker_resources"] = resources
        _check_engine_types(engine, 1)

    @classmethod
    def from_file(cls, path: str | Path) -> LLMConfig:
        """An ``LLMConfig`` from a YAML file (Ray Serve LLM's ``LLMConfig.from_file``)."""
        with open(path, encoding="utf-8") as f:
            return cls.model_validate(yaml.safe_load(f))


class LLMServingArgs(_Strict):
    """``build_openai_app``'s argument (Ray Serve LLM's ``LLMServingArgs``)."""

    #: LLMConfigs, their dicts, or paths of YAML files holding one each
    llm_configs: list[LLMConfig]
    #: refused unless empty: the ingress is raydecode's (deploy.ingress.OpenAIIngress)
    ingress_cls_config: dict[str, Any] | None = None
    #: Serve options of the ingress deployment (num_replicas, autoscaling_config, ...)
    ingress_deployment_config: dict[str, Any] = {}

    @field_validator("llm_configs", mode="before")
    @classmethod
    def _files(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        loaded = []
        for entry in value:
            if isinstance(entry, (str, Path)):
                if not Path(entry).is_file():
                    raise ValueError(f"Could not load model config from {entry}, as the file does not exist.")
                entry = LLMConfig.from_file(entry)
            loaded.append(entry)
        return loaded

    @model_validator(mode="after")
    def _models(self) -> LLMServingArgs:
        if not self.llm_configs:
            raise ValueError("llm_configs: the list of models is empty")
        seen: set[str] = set()
        for config in self.llm_configs:
            if config.model_id in seen:
                raise ValueError(f"Duplicate models found: model_id {config.model_id!r} is given twice. Make sure "
                                 "model ids are unique.")
            seen.add(config.model_id)
        names = [config.plan().name for config in self.llm_configs]
        if len(set(names)) != len(names):
            raise ValueError(f"two models get the same deployment name ({sorted(names)}): set "
                             "deployment_config.name on one")
        keys = {config.plan().api_key for config in self.llm_configs}
        if len(keys) > 1:
            raise ValueError("engine_kwargs.api_key: the app's one ingress checks one key for every model: set the "
                             "same api_key on every llm_config (or on none)")
        cls_config = self.ingress_cls_config or {}
        if cls_config.get("ingress_cls") is not None or cls_config.get("ingress_extra_kwargs"):
            raise ValueError("ingress_cls_config: a custom ingress is not supported: raydecode's ingress is "
                             "deploy.ingress.OpenAIIngress")
        unknown = sorted(set(cls_config) - {"ingress_cls", "ingress_extra_kwargs"})
        if unknown:
            raise ValueError(f"ingress_cls_config.{unknown[0]}: not an ingress_cls_config key")
        ingress = self.ingress_deployment_config
        bad = sorted(set(ingress) - set(DEPLOYMENT_KEYS) - {"max_replicas_per_node"}) or (
            ["user_config"] if ingress.get("user_config") is not None else [])
        if bad:
            raise ValueError(f"ingress_deployment_config.{bad[0]}: not supported for raydecode's ingress")
        _serve_checked("ingress_deployment_config", ingress)
        return self

    def ingress_options(self) -> dict[str, Any]:
        """The ingress deployment's Serve options: ``ingress_deployment_config``, and the
        largest ``experimental_configs.num_ingress_replicas`` where that sets no count."""
        options = dict(self.ingress_deployment_config)
        wanted = [c.experimental_configs["num_ingress_replicas"] for c in self.llm_configs
                  if "num_ingress_replicas" in c.experimental_configs]
        if wanted and "num_replicas" not in options and "autoscaling_config" not in options:
            options["num_replicas"] = max(wanted)
        return options


# -- builders -----------------------------------------------------------------------

def build_llm_deployment(llm_config: LLMConfig | dict[str, Any], *, name_prefix: str | None = None,
                         bind_kwargs: dict[str, Any] | None = None,
                         override_serve_options: dict[str, Any] | None = None,
                         deployment_cls: Any = None) -> serve.Application:
    """One model's engine deployment, bound (Ray Serve LLM's ``build_llm_deployment``):
    named ``<name_prefix or "LLMEngine:"><model_id>``; ``override_serve_options`` win over
    ``deployment_config``. Its handle speaks raydecode's engine protocol
    (``deploy.engine_server.EngineServer``), which ``build_openai_app``'s ingress calls;
    ``bind_kwargs`` and ``deployment_cls`` are not supported."""
    if bind_kwargs or deployment_cls is not None:
        raise ValueError("bind_kwargs and deployment_cls are not supported: raydecode's engine deployment is "
                         "deploy.engine_server.EngineServer")
    config = LLMConfig.model_validate(llm_config)
    if override_serve_options:
        config = LLMConfig.model_validate(
            config.model_dump() | {"deployment_config": {**config.deployment_config, **override_serve_options}})
    plan = config.plan()
    if plan.accelerator_type is not None:
        check_accelerator(plan.accelerator_type)
    prefix = DEPLOYMENT_PREFIX if name_prefix is None else name_prefix
    return engine_deployment(plan.args, name=prefix + plan.name, actor_options=plan.actor_options,
                             serve_options=plan.serve_options)


def build_openai_app(builder_config: dict[str, Any] | LLMServingArgs) -> serve.Application:
    """The OpenAI-compatible app of ``builder_config`` (``LLMServingArgs`` or its dict;
    Ray Serve LLM's ``build_openai_app``): one engine deployment per model and one
    ingress routing each request by its ``model``. In a Serve config:
    ``import_path: deploy.serve_llm:build_openai_app`` with ``args: {llm_configs: [...]}``."""
    args = LLMServingArgs.model_validate(builder_config)
    engines = {config.model_id: build_llm_deployment(config) for config in args.llm_configs}
    api_key = args.llm_configs[0].plan().api_key
    return ingress_deployment(engines, api_key, options=args.ingress_options())


def build_pd_openai_app(pd_serving_args: dict[str, Any]) -> serve.Application:
    """Ray Serve LLM's prefill/decode disaggregated app: not supported (a clear error, so
    a config that names it fails at once)."""
    raise ValueError("build_pd_openai_app: prefill/decode disaggregation (moving KV between engines) is not "
                     "supported by raydecode: each engine runs both prefill and decode; use build_openai_app")
