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

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator
import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, BackpressureConfig

from cluster.config import EngineConfig
from cluster.worker_pool import serve_bundles
from deploy.engine_server import EngineServer
from deploy.ingress import MAX_ONGOING_REQUESTS, OpenAIIngress
from deploy.openai.tool_parsers import TOOL_PARSERS
from deploy.openai.tools import DEFAULT_MAX_TOOLS
from deploy.request_router import check_router_kwargs, router_options
from worker.runner.model_loader import DEFAULT_MODEL_NAME


class StructuredOutputsConfig(BaseModel):
    """Defaults for the JSON constraints of requests that do not set them (vLLM's
    ``--structured-outputs-config``)."""

    model_config = ConfigDict(extra="forbid")

    #: compact JSON: no whitespace between tokens (a weak model may otherwise spend
    #: its tokens on whitespace)
    disable_any_whitespace: bool = False
    #: objects with ``properties`` get ``additionalProperties: false`` unless they say
    disable_additional_properties: bool = False


class ServerArgs(BaseModel):
    """The application's configuration (Serve config ``args`` or ``build_app``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the embedded SmolLM2
    served_model_name: str | None = None  # the name clients use; default: the model's
    num_workers: int = 1
    api_key: str | None = None  # clients must send "Authorization: Bearer <key>"
    chat_template: str | None = None  # for tokenizers without one
    #: further ``EngineConfig`` fields: max_num_seqs, max_model_len, logits_processors,
    #: worker_resources, address, ...
    engine: dict[str, Any] = {}
    # -- the engine deployment: its replicas, their load and how they go --
    num_replicas: int = 1  # fixed replicas (each an engine with num_workers workers)
    #: Serve's autoscaling_config for the engine replicas (min_replicas, max_replicas,
    #: target_ongoing_requests, upscale_delay_s, downscale_delay_s, ...); replaces
    #: num_replicas
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = 256  # per replica, in the engine at once
    max_queued_requests: int = 512  # waiting for a replica; beyond: 503
    retry_after_s: float = 1.0
    #: a replica leaving (scale-down, redeploy, shutdown) takes no new requests and
    #: finishes its in-flight ones for up to this long before it is stopped
    graceful_shutdown_timeout_s: float = 60.0
    #: Ray runtime_env of the engine replicas and their workers (env_vars, py_modules, ...)
    runtime_env: dict[str, Any] | None = None
    #: how the ingress picks an engine replica: "prefix_aware" (the one that cached the
    #: longest prefix of the prompt, within a load-imbalance guard; deploy/request_router.py)
    #: or "power_of_two" (Serve's default). None: prefix_aware when the engine caches
    #: prefixes (engine enable_prefix_caching, the default), else power_of_two
    request_router: Literal["prefix_aware", "power_of_two"] | None = None
    #: the prefix-aware router's settings: imbalanced_threshold (default 8 requests),
    #: match_rate_threshold, min_match_chars, eviction_threshold_chars, ...
    request_router_kwargs: dict[str, Any] = {}
    # -- tools and structured outputs (vLLM's flag names) --
    tool_call_parser: str | None = None  # the model's tool call format for tool_choice "auto": hermes, llama3_json
    enable_auto_tool_choice: bool = False  # allow tool_choice "auto" (needs tool_call_parser), as vLLM
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": leave the tools out of the prompt
    max_tools: int = DEFAULT_MAX_TOOLS  # tools in one request, at most
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    #: a file each replica (ingress and engine) appends one JSON line per request to:
    #: where its time to first token went (deploy/timeline.py); None: off
    request_timeline: str | None = None
    #: the ingress and the engine in one replica (deploy/colocated.py): no router, no
    #: gRPC hop and one process fewer per request; only with one engine replica that
    #: does not autoscale. While that replica is replaced, nothing answers HTTP
    colocate: bool = False

    def model_id(self) -> str:
        """The name clients send as ``model``: ``served_model_name``, else the model
        as given (a path or hub id), else the embedded default's name."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME

    @model_validator(mode="after")
    def _tools_make_sense(self) -> "ServerArgs":
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (as vLLM's --enable-auto-tool-choice)")
        if self.max_tools < 1:
            raise ValueError(f"max_tools must be at least 1, got {self.max_tools}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.autoscaling_config is not None:
            try:
                AutoscalingConfig(**self.autoscaling_config)
            except Exception as exc:  # pydantic's error names the field
                raise ValueError(f"autoscaling_config: {exc}") from None
        if self.graceful_shutdown_timeout_s < 0:
            raise ValueError(f"graceful_shutdown_timeout_s must be >= 0, got {self.graceful_shutdown_timeout_s}")
        if self.request_router_kwargs and self.request_router == "power_of_two":
            raise ValueError("request_router_kwargs: settings of the prefix-aware router, but request_router is "
                             "power_of_two")
        check_router_kwargs(self.request_router_kwargs)
        if self.colocate and (self.num_replicas != 1 or self.autoscaling_config is not None):
            raise ValueError("colocate: only with one engine replica (num_replicas 1, no autoscaling_config)")
        if self.colocate and (self.request_router is not None or self.request_router_kwargs):
            raise ValueError("colocate: one engine replica in the ingress's process has no request router to set "
                             "(request_router, request_router_kwargs)")
        return self


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
                       request_timeline: str | None = None) -> serve.Application:
    """The OpenAI ingress in front of ``engines`` (served model name -> bound engine
    deployment), bound; a full engine queue answers 503 with ``Retry-After``.
    ``options``: further Serve options of the ingress deployment (num_replicas, ...).
    ``request_timeline``: the file of its request timeline lines (deploy/timeline.py)."""
    # The ingress relays the engines' streams: when it is replaced (a redeploy) it
    # drains them for as long as an engine replica would (ServerArgs' default).
    options = {"graceful_shutdown_timeout_s": ServerArgs.model_fields["graceful_shutdown_timeout_s"].default,
               **(options or {})}
    return OpenAIIngress.options(
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=retry_after_s), **options,
    ).bind(engines, api_key, retry_after_s, request_timeline)


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
                              parsed.request_timeline)
