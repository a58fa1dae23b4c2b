"""Ray Serve LLM's app builders on raydecode: ``build_openai_app`` (one engine
deployment per model and one OpenAI ingress routing each request by its ``model``),
``build_llm_deployment`` (one model's engine deployment, named ``LLMEngine:<model_id>``)
and ``build_pd_openai_app``, which refuses prefill/decode disaggregation.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from deploy.serve import engine_deployment, ingress_deployment
from deploy.serve_llm.llm_config import LLMConfig, LLMServingArgs
from deploy.serve_llm.placement import check_accelerator

#: Ray Serve LLM names each engine deployment ``LLMServer:<model_id>``; ours are engines.
DEPLOYMENT_PREFIX = "LLMEngine:"


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
    lora = {"modules": [], "runtime_updates": False,
            "dynamic": {c.model_id: c.plan().args.dynamic_lora_loading_path for c in args.llm_configs
                        if c.plan().args.dynamic_lora_loading_path}}
    return ingress_deployment(engines, api_key, options=args.ingress_options(), lora=lora)


def build_pd_openai_app(pd_serving_args: dict[str, Any]) -> serve.Application:
    """Ray Serve LLM's prefill/decode disaggregated app: not supported (a clear error, so
    a config that names it fails at once)."""
    raise ValueError("build_pd_openai_app: prefill/decode disaggregation (moving KV between engines) is not "
                     "supported by raydecode: each engine runs both prefill and decode; use build_openai_app")
