"""Ray Serve LLM's ``deployment_config`` in raydecode's terms: the replica count or
autoscaling, the queue bounds and drain time become ``ServerArgs`` fields, the
``ray_actor_options`` the engine replicas' actor options, and the health checks,
logging and request router further Serve options (Ray's ``PrefixCacheAffinityRouter``
becomes raydecode's prefix-aware router). Serve's own validators check the options
first, so a bad value is a ``ValueError`` naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from deploy.request_router import from_ray_serve_llm

#: The ``deployment_config`` keys Ray Serve LLM documents.
DEPLOYMENT_KEYS = ("name", "num_replicas", "ray_actor_options", "max_ongoing_requests", "autoscaling_config",
                   "max_queued_requests", "user_config", "health_check_period_s", "health_check_timeout_s",
                   "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s", "logging_config",
                   "request_router_config")
#: Of these, the ones handed to Serve as they are.
_PASSED_TO_SERVE = ("health_check_period_s", "health_check_timeout_s", "graceful_shutdown_wait_loop_s",
                    "logging_config", "request_router_config")


def check_serve_options(where: str, options: dict[str, Any]) -> None:
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
    check_serve_options("deployment_config", config)
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

