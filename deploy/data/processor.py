"""``Processor`` and ``build_processor`` in Ray Data LLM's shape: a processor maps a
Ray Dataset through ``preprocess`` -> its stages -> ``postprocess``, lazily (nothing
runs until the dataset is consumed; rows stream through, the first results are ready
while later rows are still being read).

Columns travel with the row: ``preprocess``'s output is added to the row's own columns,
each stage adds its columns, and ``postprocess`` gets them all and chooses what to keep.
A row marked failed (``__inference_error__``, with ``should_continue_on_error``)
bypasses ``postprocess``; every row then carries the column ("" where it succeeded).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.config import EngineConfig
from cluster.placement import rank_resources, resources_bundle
from deploy.data.config import POOLING_TASK_TYPES, ProcessorConfig, pool_size, vLLMEngineProcessorConfig
from deploy.data.engine_stage import EngineStage
from deploy.data.rows import ERROR_COLUMN
from deploy.data.stages import ChatTemplateStage, TokenizeStage

logger = logging.getLogger("ray.data")

#: CPUs Ray reserves for each task or actor of the light stages (preprocess,
#: postprocess, chat template, tokenize) unless their config says otherwise: a
#: quarter, not Ray's default of one, so they fit beside the engine's CPU workers
#: (whose reservation is a token: one CPU per worker) on a small machine
LIGHT_CPUS = 0.25

#: A row's preprocess / postprocess: one dict in, one dict out
RowFunction = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class Stage:
    """One ``map_batches`` of the processor: the callable class, its constructor's
    arguments, the rest of ``map_batches``' arguments, and the columns it reads."""

    fn: type
    fn_constructor_kwargs: dict[str, Any]
    map_batches_kwargs: dict[str, Any]
    required_input_keys: dict[str, str] = field(default_factory=dict)
    optional_input_keys: dict[str, str] = field(default_factory=dict)


class Processor:
    def __init__(self, config: ProcessorConfig, stages: list[Stage], preprocess: RowFunction | None = None,
                 postprocess: RowFunction | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                 postprocess_map_kwargs: dict[str, Any] | None = None,
                 reservation: dict[str, float] | None = None) -> None:
        self.config = config
        #: what one engine replica's workers reserve (CPU, GPU), outside Ray Data's view
        self.reservation = reservation or {}
        self.stages: dict[str, Stage] = {stage.fn.__name__: stage for stage in stages}
        self.preprocess = _with_columns(preprocess) if preprocess is not None else None
        continue_on_error = bool(getattr(config, "should_continue_on_error", False))
        self.postprocess = (_bypassing_errors(postprocess, continue_on_error) if postprocess is not None else None)
        self.preprocess_map_kwargs = {"num_cpus": LIGHT_CPUS, **(preprocess_map_kwargs or {})}
        self.postprocess_map_kwargs = {"num_cpus": LIGHT_CPUS, **(postprocess_map_kwargs or {})}

    def __call__(self, dataset: Any) -> Any:
        """``dataset`` through the processor (lazy: returns the mapped Dataset)."""
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess, **self.preprocess_map_kwargs)
        for stage in self.stages.values():
            dataset = dataset.map_batches(stage.fn, fn_constructor_kwargs=stage.fn_constructor_kwargs,
                                          **stage.map_batches_kwargs)
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess, **self.postprocess_map_kwargs)
        if self.reservation:
            # The replicas' workers are Ray actors of their own, which Ray Data does not
            # see: its budget leaves their resources to them, else its tasks could take
            # the CPUs (or GPUs) the workers wait for while those tasks wait on the
            # replicas (Ray Data LLM's vLLM stage reserves them on the replica instead).
            exclude_replica_workers(dataset.context, self.reservation, pool_size(self.config.concurrency)["max_size"])
        return dataset

    def list_stage_names(self) -> list[str]:
        return list(self.stages)

    def get_stage_by_name(self, name: str) -> Stage:
        if name not in self.stages:
            raise ValueError(f"Stage {name} not found")
        return self.stages[name]

    def log_input_column_names(self) -> None:
        """Logs the columns the first stage reads (what ``preprocess`` must produce)."""
        name, stage = next(iter(self.stages.items()))
        message = f"The first stage of the processor is {name}."
        if stage.required_input_keys:
            message += "\nRequired input columns:\n" + "\n".join(
                f"\t{k}: {v}" for k, v in stage.required_input_keys.items())
        if stage.optional_input_keys:
            message += "\nOptional input columns:\n" + "\n".join(
                f"\t{k}: {v}" for k, v in stage.optional_input_keys.items())
        logger.info(message)


def replica_reservation(engine: EngineConfig) -> dict[str, float]:
    """The CPUs and GPUs one replica's workers reserve (every rank of every worker)."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    rank = resources_bundle(rank_resources(engine, gpus))
    ranks = engine.num_workers * engine.group_size
    return {"CPU": rank.get("CPU", 0.0) * ranks, "GPU": rank.get("GPU", 0.0) * ranks}


def exclude_replica_workers(context: Any, reservation: dict[str, float], replicas: int) -> None:
    """Leaves ``replicas`` replicas' worker reservations out of Ray Data's budget (its
    ``exclude_resources``, deprecated for 2027 in favour of node labels, which cannot
    say "leave this much of every node")."""
    from ray.data import ExecutionResources

    options = context.execution_options
    # Datasets derived from one another share a context: what an earlier processor on
    # it excluded is replaced, not added to.
    before = context.get_config("raydecode_excluded", (0.0, 0.0))
    cpu, gpu = reservation.get("CPU", 0.0) * replicas, reservation.get("GPU", 0.0) * replicas
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*exclude_resources.*")
        current = options.exclude_resources
        options.exclude_resources = ExecutionResources(
            cpu=(current.cpu or 0.0) - before[0] + cpu, gpu=(current.gpu or 0.0) - before[1] + gpu,
            object_store_memory=current.object_store_memory, memory=current.memory)
    context.set_config("raydecode_excluded", (cpu, gpu))


def _with_columns(fn: RowFunction) -> RowFunction:
    def preprocess(row: dict[str, Any]) -> dict[str, Any]:
        out = fn(row)
        if not isinstance(out, dict):
            raise ValueError(f"preprocess must return a dict, got {type(out).__name__}")
        return {**row, **out}

    return preprocess


def _bypassing_errors(fn: RowFunction, include_error_column: bool) -> RowFunction:
    def postprocess(row: dict[str, Any]) -> dict[str, Any]:
        if row.get(ERROR_COLUMN):
            return row
        out = fn(row)
        if not isinstance(out, dict):
            raise ValueError(f"postprocess must return a dict, got {type(out).__name__}")
        if include_error_column:
            out[ERROR_COLUMN] = ""
        return out

    return postprocess


def _cpu_stage_kwargs(stage: Any) -> dict[str, Any]:
    import ray.data

    size = {"size": 1} if stage.concurrency is None else pool_size(stage.concurrency)
    kwargs: dict[str, Any] = {"compute": ray.data.ActorPoolStrategy(**size), "batch_size": stage.batch_size,
                              "batch_format": "pyarrow", "zero_copy_batch": True}
    for name in ("runtime_env", "memory"):
        if getattr(stage, name) is not None:
            kwargs[name] = getattr(stage, name)
    kwargs["num_cpus"] = stage.num_cpus if stage.num_cpus is not None else LIGHT_CPUS
    return kwargs


def build_engine_processor(config: vLLMEngineProcessorConfig, *, preprocess: RowFunction | None = None,
                           postprocess: RowFunction | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                           preprocess_map_kwargs: dict[str, Any] | None = None,
                           postprocess_map_kwargs: dict[str, Any] | None = None) -> Processor:
    import ray.data

    spec = config.engine_spec()
    engine = spec.config()
    trust = bool(spec.engine.get("trust_remote_code", False))
    common = {"trust_remote_code": trust, "should_continue_on_error": config.should_continue_on_error}
    stages: list[Stage] = []
    chat = config.stage("chat_template_stage")
    if chat.enabled:
        stages.append(Stage(ChatTemplateStage, {
            "model": chat.model_source, "chat_template": chat.chat_template or spec.chat_template,
            "chat_template_kwargs": chat.chat_template_kwargs or chat_template_kwargs, **common,
        }, _cpu_stage_kwargs(chat), {"messages": "A list of messages in OpenAI chat format."}))
    tokenize = config.stage("tokenize_stage")
    if tokenize.enabled:
        stages.append(Stage(TokenizeStage, {"model": tokenize.model_source, "after_chat_template": chat.enabled,
                                            **common},
                            _cpu_stage_kwargs(tokenize), {"prompt": "The text prompt (str)."}))
    # The replica reserves no CPU of its own; its workers reserve theirs, outside Ray
    # Data's view (the processor tells it, see Processor.__call__). Ray Data restarts a
    # replica that dies and retries its batches (max_restarts and max_task_retries -1:
    # its defaults for actor pools).
    engine_kwargs: dict[str, Any] = {
        "compute": ray.data.ActorPoolStrategy(**pool_size(config.concurrency),
                                              max_tasks_in_flight_per_actor=config.max_tasks_in_flight_per_actor,
                                              max_concurrent_calls_per_actor=config.max_concurrent_batches),
        "batch_size": config.batch_size, "batch_format": "pyarrow", "zero_copy_batch": True, "num_cpus": 0,
    }
    if config.runtime_env is not None:
        engine_kwargs["runtime_env"] = config.runtime_env
    pooling = spec.task in POOLING_TASK_TYPES
    stages.append(Stage(EngineStage, {
        "spec": spec, "pending_limit": config.pending_limit(engine),
        "should_continue_on_error": config.should_continue_on_error,
        "dynamic_lora_loading_path": config.dynamic_lora_loading_path,
    }, engine_kwargs, {} if pooling else {
        "sampling_params": "The sampling parameters (a dict of vLLM's SamplingParams fields)."}, {
        "prompt": "The text prompt (str). Required if tokenized_prompt is not provided.",
        "tokenized_prompt": "The tokenized prompt. Required if prompt is not provided.",
        **({"pooling_params": "The pooling parameters (a dict of vLLM's PoolingParams fields); default ones "
                              "if not given."} if pooling else {
            "model": "The model for this row: another name than the processor's is a LoRA adapter "
                     "(dynamic_lora_loading_path/<model>)."}),
    }))
    return Processor(config, stages, preprocess=preprocess, postprocess=postprocess,
                     preprocess_map_kwargs=preprocess_map_kwargs, postprocess_map_kwargs=postprocess_map_kwargs,
                     reservation=replica_reservation(engine))


def _start_ray(runtime_env: dict[str, Any] | None) -> None:
    """Starts Ray where it is not running, as Ray Data LLM's ``build_processor`` does,
    with Ray's workers at niceness 0 (``serving_priority_env``, as ``raydecode serve``):
    each replica's engine then gets a core at once beside its model worker's threads,
    which raise themselves to 15 (with Ray's default of 15 for every actor the engine
    waits its turn behind them: 0.87x LLM.generate's tok/s on 2 cores, against 1.00x)."""
    import ray

    if ray.is_initialized():
        return
    from deploy.serve_env import serving_priority_env

    for key, value in serving_priority_env().items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(runtime_env=runtime_env, ignore_reinit_error=True)


def build_processor(config: ProcessorConfig, preprocess: RowFunction | None = None,
                    postprocess: RowFunction | None = None, preprocess_map_kwargs: dict[str, Any] | None = None,
                    postprocess_map_kwargs: dict[str, Any] | None = None,
                    builder_kwargs: dict[str, Any] | None = None) -> Processor:
    """A processor for ``config`` (Ray Data LLM's ``build_processor``): ``preprocess``
    turns each row into the stages' input columns (``messages`` or ``prompt``,
    ``sampling_params``), ``postprocess`` picks the output's columns from each row.
    ``builder_kwargs``: ``chat_template_kwargs`` (the chat template's variables)."""
    if not isinstance(config, vLLMEngineProcessorConfig):
        raise ValueError(f"config: raydecode builds processors for vLLMEngineProcessorConfig only (its engine "
                         f"stands in for vLLM's), got {type(config).__name__}")
    unknown = sorted(set(builder_kwargs or {}) - {"chat_template_kwargs"})
    if unknown:
        raise ValueError(f"builder_kwargs.{unknown[0]}: not an argument of this processor (chat_template_kwargs is)")
    _start_ray(config.runtime_env)
    return build_engine_processor(config, preprocess=preprocess, postprocess=postprocess,
                                  preprocess_map_kwargs=preprocess_map_kwargs,
                                  postprocess_map_kwargs=postprocess_map_kwargs, **(builder_kwargs or {}))


__all__ = ["Processor", "Stage", "build_processor"]
