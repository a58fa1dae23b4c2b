"""Ray Data LLM's processor configuration with Ray's names (``ray/data/llm.py``):
``ProcessorConfig``, ``vLLMEngineProcessorConfig`` and the per-stage configs. The
engine's ``engine_kwargs`` are vLLM's, mapped onto raydecode's ``EngineConfig`` by the
same code as a Ray Serve LLM config (``deploy.serve_llm``); what raydecode cannot honour
is a ``ValueError`` naming the field when the config is built, before Ray starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from cluster.config import EngineConfig
from deploy.serve_llm.engine_kwargs import check_engine_types, map_engine_kwargs
from deploy.serve_llm.placement import checked_accelerator_type, place_workers
from worker.lora_fetch import check_location

#: Ray Data LLM's task types; raydecode runs "generate" (the rest need a pooling path)
TASK_TYPES = ("generate", "embed", "classify", "score", "reward")
#: the pooling tasks raydecode runs (Ray's score and reward are vLLM's reward models)
POOLING_TASK_TYPES = ("embed", "classify")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), arbitrary_types_allowed=True)


def _check_concurrency(value: Any, where: str) -> Any:
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, bool) or not isinstance(value, (int, tuple)):
        raise ValueError(f"{where}: expected a positive int or a (min, max) pair, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{where}: a positive integer is expected, got {value}")
        return value
    if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(f"{where}: the (min, max) pair must hold two positive integers, got {value!r}")
    if value[0] > value[1]:
        raise ValueError(f"{where}: min > max in {value!r}")
    return value


def pool_size(concurrency: int | tuple[int, int]) -> dict[str, int]:
    """An actor pool's size as Ray Data LLM reads ``concurrency``: ``n`` scales from 1 to
    ``n``, ``(m, n)`` from ``m`` to ``n``."""
    if isinstance(concurrency, int):
        return {"min_size": 1, "max_size": concurrency}
    return {"min_size": concurrency[0], "max_size": concurrency[1]}


class ProcessorConfig(_Strict):
    """What every processor takes: rows per batch, the accelerator its engine stage
    needs, and how many engine replicas run (``n``: from 1 to ``n``; ``(m, n)``)."""

    batch_size: int = 32
    accelerator_type: str | None = None
    concurrency: int | tuple[int, int] = 1

    @field_validator("batch_size")
    @classmethod
    def _batch_size(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"batch_size: must be at least 1, got {value}")
        return value

    @field_validator("concurrency", mode="before")
    @classmethod
    def _concurrency(cls, value: Any) -> Any:
        return _check_concurrency(value, "concurrency")

    @field_validator("accelerator_type")
    @classmethod
    def _accelerator(cls, value: str | None) -> str | None:
        return None if value is None else checked_accelerator_type(value)


class _StageConfig(_Strict):
    enabled: bool = True
    batch_size: int | None = None
    concurrency: int | tuple[int, int] | None = None
    runtime_env: dict[str, Any] | None = None
    num_cpus: float | None = None
    memory: float | None = None

    @field_validator("concurrency", mode="before")
    @classmethod
    def _concurrency(cls, value: Any) -> Any:
        return None if value is None else _check_concurrency(value, "concurrency")


class ChatTemplateStageConfig(_StageConfig):
    """Renders each row's ``messages`` into ``prompt`` with the model's chat template."""

    model_source: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizerStageConfig(_StageConfig):
    """Tokenizes each row's ``prompt`` into ``tokenized_prompt``."""

    model_source: str | None = None


class DetokenizeStageConfig(_StageConfig):
    """Decodes each row's ``generated_tokens`` into ``generated_text``."""

    model_source: str | None = None


class PrepareMultimodalStageConfig(_StageConfig):
    """Accepted for Ray's shape; raydecode serves text models only (enabled: refused)."""

    enabled: bool = False
    model_config_kwargs: dict[str, Any] | None = None
    chat_template_content_format: str | None = "string"
    apply_sys_msg_formatting: bool | None = False


def resolve_stage(value: Any, cls: type[_StageConfig], defaults: dict[str, Any], where: str) -> _StageConfig:
    """A stage's config (``bool``, ``dict`` or the typed config) with the processor's
    defaults (batch size, concurrency, runtime env, model) where it sets none."""
    if isinstance(value, cls):
        stage = cls.model_validate(value.model_dump())
    elif isinstance(value, bool):
        stage = cls(enabled=value)
    elif isinstance(value, dict):
        try:
            stage = cls(**value)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    else:
        raise ValueError(f"{where}: expected a bool, a dict or a {cls.__name__}, got {type(value).__name__}")
    for name, default in defaults.items():
        if name in type(stage).model_fields and getattr(stage, name) is None:
            setattr(stage, name, default)
    return stage


@dataclass(frozen=True)
class EngineSpec:
    """The engine stage in raydecode's terms: what each replica's ``AsyncLLM`` gets."""

    model: str | None
    #: ``EngineConfig`` fields
    engine: dict[str, Any] = field(default_factory=dict)
    #: the chat template engine_kwargs name (vLLM's frontend argument), if any
    chat_template: str | None = None
    #: Ray's task type: "generate", or a pooling model's "embed" / "classify"
    task: str = "generate"

    def config(self) -> EngineConfig:
        return EngineConfig(model=self.model, **self.engine)


class vLLMEngineProcessorConfig(ProcessorConfig):  # noqa: N801 (Ray's name)
    """Ray Data LLM's ``vLLMEngineProcessorConfig``: raydecode's engine stands in for
    vLLM's. ``model_source``: a local model folder or file (None: the embedded SmolLM2);
    ``engine_kwargs``: vLLM's engine arguments (``deploy/README.md`` lists those raydecode
    takes)."""

    model_source: str | None = None
    engine_kwargs: dict[str, Any] = {}
    task_type: str = "generate"
    runtime_env: dict[str, Any] | None = None
    max_pending_requests: int | None = None
    max_concurrent_batches: int = 8
    max_tasks_in_flight_per_actor: int | None = None
    should_continue_on_error: bool = False
    log_engine_metrics: bool = True
    dynamic_lora_loading_path: str | None = None
    placement_group_config: dict[str, Any] | None = None
    chat_template_stage: Any = True
    tokenize_stage: Any = True
    detokenize_stage: Any = True
    prepare_multimodal_stage: Any = False

    @field_validator("task_type")
    @classmethod
    def _task_type(cls, value: str) -> str:
        if value not in TASK_TYPES:
            raise ValueError(f"task_type: invalid task type {value!r} (Ray Data LLM's: {', '.join(TASK_TYPES)})")
        if value not in POOLING_TASK_TYPES + ("generate",):
            raise ValueError(f"task_type: {value!r} is not supported by raydecode yet (it runs 'generate', "
                             f"{', '.join(repr(t) for t in POOLING_TASK_TYPES)})")
        return value

    @field_validator("max_pending_requests", "max_tasks_in_flight_per_actor")
    @classmethod
    def _positive_or_none(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @field_validator("max_concurrent_batches")
    @classmethod
    def _batches(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"max_concurrent_batches: must be at least 1, got {value}")
        return value

    @field_validator("dynamic_lora_loading_path")
    @classmethod
    def _lora_path(cls, value: str | None) -> str | None:
        return value if value is None else check_location(value, "dynamic_lora_loading_path")

    @model_validator(mode="after")
    def _mapped(self) -> vLLMEngineProcessorConfig:
        self.engine_spec()
        for name, cls in self.stage_classes().items():
            resolve_stage(getattr(self, name), cls, {}, name)
        if resolve_stage(self.prepare_multimodal_stage, PrepareMultimodalStageConfig, {},
                         "prepare_multimodal_stage").enabled:
            raise ValueError("prepare_multimodal_stage: multimodal inputs are not supported by raydecode "
                             "(it serves text models)")
        return self

    @staticmethod
    def stage_classes() -> dict[str, type[_StageConfig]]:
        return {"chat_template_stage": ChatTemplateStageConfig, "tokenize_stage": TokenizerStageConfig,
                "detokenize_stage": DetokenizeStageConfig}

    def stage(self, name: str) -> _StageConfig:
        """One CPU stage's config, resolved against the processor's defaults."""
        defaults = {"batch_size": self.batch_size, "concurrency": self.concurrency,
                    "runtime_env": self.runtime_env, "model_source": self.model_source}
        return resolve_stage(getattr(self, name), self.stage_classes()[name], defaults, name)

    def engine_spec(self) -> EngineSpec:
        """The engine stage in raydecode's terms (``ValueError`` naming what it cannot be)."""
        kwargs = {k: v for k, v in self.engine_kwargs.items() if k != "task_type"}
        server, engine, api_key = map_engine_kwargs(kwargs, self.model_source or "")
        if api_key is not None:
            raise ValueError("engine_kwargs.api_key: a batch job has no HTTP endpoint to guard")
        for name in sorted(set(server) - {"num_workers", "chat_template"}):
            raise ValueError(f"engine_kwargs.{name}: an OpenAI server argument; a batch job does not take it")
        if "num_workers" in server:
            engine["num_workers"] = server["num_workers"]
        if self.dynamic_lora_loading_path is not None:
            engine.setdefault("enable_lora", True)
        if self.task_type in POOLING_TASK_TYPES:
            if engine.get("runner", "pooling") != "pooling":
                raise ValueError(f"engine_kwargs.runner: task_type {self.task_type!r} runs a pooling model "
                                 f"(runner 'pooling'), got {engine['runner']!r}")
            engine["runner"] = "pooling"  # (Ray's vLLM stage sets it for these tasks too)
        place_workers(engine, self.placement_group_config, None, self.accelerator_type)
        check_engine_types({k: v for k, v in engine.items() if k != "num_workers"}, engine.get("num_workers", 1))
        return EngineSpec(model=self.model_source, engine=engine, chat_template=server.get("chat_template"),
                          task=self.task_type)

    def pending_limit(self, engine: EngineConfig) -> int:
        """Requests one replica (of ``engine``) holds at once: ``max_pending_requests``,
        else 1.1x the sequences its workers run together (Ray's rule over vLLM's
        ``max_num_seqs``)."""
        if self.max_pending_requests is not None:
            return self.max_pending_requests
        return math.ceil(1.1 * engine.max_num_seqs * engine.num_workers * engine.pipeline_parallel_size)
