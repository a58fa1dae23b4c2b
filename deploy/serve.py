"""The Ray Serve application: vLLM's OpenAI-compatible HTTP API over ``AsyncLLM``, as
Ray Serve LLM builds it: an ingress deployment (``deploy/ingress.py``: HTTP, parsing,
validation, the API key, routing by ``model``) in front of an engine deployment
(``deploy/engine_server.py``: the engine, its workers, the OpenAI protocol) that it calls
through a deployment handle. The engine deployment is what scales (``num_replicas`` or
``autoscaling_config``); a replica leaving (scale-down, a redeploy) stops taking requests
and finishes the ones it has within ``graceful_shutdown_timeout_s``.

Build it with ``build_app({...})`` (``serve.run(build_app({"model": ...}))``) or from a
Serve config (``deploy/serve.yaml``: ``import_path: deploy.serve:build_app``); the
arguments are ``ServerArgs``. Logits processors are named only here, in ``engine``.
"""

from typing import Any

import ray
from ray import serve
from ray.serve.config import BackpressureConfig

from cluster.config import EngineConfig
from cluster.worker_pool import serve_bundles
from deploy.engine_server import EngineServer
from deploy.ingress import MAX_ONGOING_REQUESTS, OpenAIIngress
from deploy.request_router import router_options
from deploy.server_args import ServerArgs, StructuredOutputsConfig

__all__ = ["ServerArgs", "StructuredOutputsConfig", "build_app", "colocated_deployment", "engine_deployment",
           "ingress_deployment"]


def _engine_replica_options(parsed: ServerArgs, actor_options: dict[str, Any] | None = None
                            ) -> tuple[EngineConfig, dict[str, Any]]:
    """(the engine's configuration, the Serve options of a replica that holds it): its
    drain time, ``ray_actor_options`` (``actor_options`` over no CPU of its own, and
    ``runtime_env``) and, for model-parallel workers, every rank's placement-group
    bundle. Its load limits are the caller's."""
    engine = EngineConfig(num_workers=parsed.num_workers, **{k: v for k, v in parsed.engine.items() if k != "model"})
    replica_options: dict[str, Any] = {"num_cpus": 0, **(actor_options or {})}
    if parsed.runtime_env is not None:
        replica_options["runtime_env"] = parsed.runtime_env
    options: dict[str, Any] = {"health_check_period_s": 10, "ray_actor_options": replica_options,
                               "graceful_shutdown_timeout_s": parsed.graceful_shutdown_timeout_s}
    if engine.group_size > 1:
        # Model-parallel workers: the replica reserves every rank's bundle with its own
        # (Ray Serve LLM's way), so it never starts with half its ranks.
        gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
        options.update(placement_group_bundles=serve_bundles(engine, gpus),
                       placement_group_strategy=engine.placement_group_strategy)
    return engine, options


def engine_deployment(parsed: ServerArgs, name: str = "LLMEngine",
                      actor_options: dict[str, Any] | None = None,
                      serve_options: dict[str, Any] | None = None) -> serve.Application:
    """The engine deployment of ``parsed``, bound: its replicas, load limits, drain
    time and (for model-parallel workers) every rank's placement-group bundle.
    ``actor_options``: further ``ray_actor_options`` of its replicas (resources,
    ``accelerator_type``). ``serve_options``: further Serve deployment options
    (health_check_period_s, health_check_timeout_s, logging_config, ...), over the
    defaults here."""
    engine, options = _engine_replica_options(parsed, actor_options)
    options.update(max_ongoing_requests=parsed.max_ongoing_requests, max_queued_requests=parsed.max_queued_requests)
    if parsed.autoscaling_config is not None:
        options.update(num_replicas="auto", autoscaling_config=parsed.autoscaling_config)
    else:
        options.update(num_replicas=parsed.num_replicas)
    options.update(router_options(parsed.request_router, parsed.request_router_kwargs, engine.enable_prefix_caching))
    return serve.deployment(EngineServer).options(name=name, **options | (serve_options or {})).bind(parsed.model_dump())


def ingress_deployment(engines: dict[str, serve.Application], api_key: str | None = None,
                       retry_after_s: float = 1.0, options: dict[str, Any] | None = None,
                       request_timeline: str | None = None,
                       responses_store: dict[str, Any] | None = None,
                       lora: dict[str, Any] | None = None) -> serve.Application:
    """The OpenAI ingress in front of ``engines`` (served model name -> bound engine
    deployment), bound; a full engine queue answers 503 with ``Retry-After``.
    ``options``: further Serve options of the ingress deployment (num_replicas, ...).
    ``request_timeline``: the file of its request timeline lines (deploy/timeline.py).
    ``responses_store``: the Responses API store's settings (None: none); ``lora``: the LoRA
    adapters it serves (``ServerArgs.lora``)."""
    # The ingress relays the engines' streams: when it is replaced (a redeploy) it
    # drains them for as long as an engine replica would (ServerArgs' default).
    options = {"graceful_shutdown_timeout_s": ServerArgs.model_fields["graceful_shutdown_timeout_s"].default,
               **(options or {})}
    return OpenAIIngress.options(
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=retry_after_s), **options,
    ).bind(engines, api_key, retry_after_s, request_timeline, responses_store, lora)


def colocated_deployment(parsed: ServerArgs) -> serve.Application:
    """The ingress with the one engine in its replica (``deploy/colocated.py``), bound:
    the engine replica's options on it, except that Serve limits its requests as it
    does the ingress's (the engine's limits are kept in the replica, for generations
    alone, so ``/metrics`` and ``/health`` never wait behind them)."""
    from deploy.colocated import ColocatedServer

    _, options = _engine_replica_options(parsed)
    return serve.deployment(ColocatedServer).options(
        name="LLMServer", num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=parsed.retry_after_s), **options,
    ).bind(parsed.model_dump())


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application (``serve.run(build_app({...}))``, or ``import_path:
    deploy.serve:build_app`` in a Serve config): the OpenAI ingress and, behind it, the
    engine deployment."""
    parsed = ServerArgs.model_validate(args or {})
    if parsed.colocate:
        return colocated_deployment(parsed)
    return ingress_deployment({parsed.model_id(): engine_deployment(parsed)}, parsed.api_key, parsed.retry_after_s,
                              {"graceful_shutdown_timeout_s": parsed.graceful_shutdown_timeout_s},
                              parsed.request_timeline, parsed.responses_store(), parsed.lora())
