"""Ray Serve LLM's configuration models with Ray's field names: ``LLMConfig`` (one
model's deployment), ``ModelLoadingConfig``, ``AcceleratorConfig`` and
``LLMServingArgs`` (``build_openai_app``'s argument). Each ``LLMConfig`` is mapped into
raydecode's terms (an ``EnginePlan``: the engine deployment's ``ServerArgs``, name and
Serve options) and checked when it is built, without Ray; what it cannot honour is a
``ValueError`` naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator, model_validator

from deploy.serve_llm.deployment_config import DEPLOYMENT_KEYS, check_serve_options, map_deployment_config
from deploy.serve_llm.engine_kwargs import check_engine_types, map_engine_kwargs
from deploy.serve_llm.placement import checked_accelerator_type, place_workers
from deploy.server_args import ServerArgs
from worker.lora_fetch import check_location

logger = logging.getLogger("ray.serve")

_REMOTE_PREFIXES = ("s3://", "gs://", "abfss://", "azure://", "pyarrow-")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class LoraConfig(_Strict):
    """Ray Serve LLM's ``lora_config``. ``dynamic_lora_loading_path`` is a local folder
    or a URI of remote storage (``worker/lora_fetch.py`` copies an adapter to each node
    that uses it, three tries per file); the download settings are accepted and not
    applied."""

    dynamic_lora_loading_path: str | None = None
    max_num_adapters_per_replica: int = 16
    download_timeout_s: float | None = 30.0
    max_download_tries: int = 3

    @model_validator(mode="after")
    def _positive(self) -> LoraConfig:
        if self.max_num_adapters_per_replica < 1:
            raise ValueError(f"max_num_adapters_per_replica must be at least 1, got {self.max_num_adapters_per_replica}")
        if self.dynamic_lora_loading_path is not None:
            check_location(self.dynamic_lora_loading_path, "dynamic_lora_loading_path")
        return self


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
    """One model's deployment, with Ray Serve LLM's field names (see ``deploy.serve_llm``'s doc for
    how each maps). Built (and checked) without Ray."""

    model_loading_config: ModelLoadingConfig
    runtime_env: dict[str, Any] | None = None
    #: Ray Serve LLM's only value; raydecode's engine stands in for vLLM
    llm_engine: str = "vLLM"
    engine_kwargs: dict[str, Any] = {}
    accelerator_type: str | None = None
    accelerator_config: AcceleratorConfig | None = None
    placement_group_config: dict[str, Any] | None = None
    #: Ray Serve LLM's LoRA settings: adapters loaded from ``dynamic_lora_loading_path``
    #: on first use (a request's ``model`` "<model_id>:<adapter>"), routed to a
    #: replica that has them loaded (Serve's model multiplexing)
    lora_config: LoraConfig | None = None
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
        return None if value is None else checked_accelerator_type(value)

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
        if self.lora_config is not None:
            server["dynamic_lora_loading_path"] = self.lora_config.dynamic_lora_loading_path
            engine.setdefault("enable_lora", True)
            # Serve's adapters per replica (max_num_adapters_per_replica) are the ones a worker keeps
            engine.setdefault("max_cpu_loras", max(self.lora_config.max_num_adapters_per_replica,
                                                   int(engine.get("max_loras", 1))))
        kind = self.accelerator_config.kind if self.accelerator_config is not None else None
        place_workers(engine, self.placement_group_config, kind, self.accelerator_type)
        check_engine_types(engine, 1)
        deployment_server, actor, serve_options = map_deployment_config(self.deployment_config)
        runtime_env = {**(actor.pop("runtime_env", None) or {}), **(self.runtime_env or {})}
        args = ServerArgs.model_validate({
            "model": model, "served_model_name": self.model_id, **server, **deployment_server, "engine": engine,
            "runtime_env": runtime_env or None,
        })
        name = self.deployment_config.get("name") or self.model_id.replace("/", "--").replace(".", "_")
        return EnginePlan(args=args, name=name, actor_options=actor, serve_options=serve_options,
                          api_key=api_key, accelerator_type=self.accelerator_type)

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
        check_serve_options("ingress_deployment_config", ingress)
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

