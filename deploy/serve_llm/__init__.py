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
  ``speculative_config`` (n-gram and draft-model methods), ...), raydecode's
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

Modules:
  llm_config         the configuration models (LLMConfig, LLMServingArgs) and their
                     mapping to raydecode's engine deployment (EnginePlan)
  engine_kwargs      vLLM's engine arguments -> ServerArgs / EngineConfig fields, and the
                     refusals of those raydecode cannot honour
  deployment_config  Ray Serve LLM's deployment_config -> raydecode's Serve options
  placement          accelerator_type and placement_group_config -> the workers'
                     resources, and the accelerator check against the running cluster
  builders           build_openai_app, build_llm_deployment, build_pd_openai_app
"""

from deploy.serve_llm.builders import DEPLOYMENT_PREFIX, build_llm_deployment, build_openai_app, build_pd_openai_app
from deploy.serve_llm.deployment_config import DEPLOYMENT_KEYS, map_deployment_config
from deploy.serve_llm.engine_kwargs import (
    ALWAYS,
    LORA_KWARGS,
    PD_KWARGS,
    RENAMED,
    SERVER_FIELDS,
    VLLM_ONLY,
    map_engine_kwargs,
)
from deploy.serve_llm.llm_config import AcceleratorConfig, EnginePlan, LLMConfig, LLMServingArgs, ModelLoadingConfig
from deploy.serve_llm.placement import (
    accelerator_resource,
    accelerator_types,
    check_accelerator,
    missing_accelerator,
)

__all__ = [
    "ALWAYS", "DEPLOYMENT_KEYS", "DEPLOYMENT_PREFIX", "LORA_KWARGS", "PD_KWARGS", "RENAMED", "SERVER_FIELDS",
    "VLLM_ONLY", "AcceleratorConfig", "EnginePlan", "LLMConfig", "LLMServingArgs", "ModelLoadingConfig",
    "accelerator_resource", "accelerator_types", "build_llm_deployment", "build_openai_app", "build_pd_openai_app",
    "check_accelerator", "map_deployment_config", "map_engine_kwargs", "missing_accelerator",
]
