"""Building the processor set: built-ins, then entry points, then configured classes."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from importlib.metadata import entry_points

import torch

from sampler.config import SamplerConfig
from sampler.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from sampler.logits_processor.interface import LogitsProcessor
from sampler.logits_processor.state import LogitsProcessors
from sampler.params import SamplingParams

logger = logging.getLogger(__name__)

#: Entry-point group through which installed packages contribute processors.
LOGITSPROCS_GROUP = "raydecode.logits_processors"

BUILTIN_LOGITS_PROCESSORS: list[type[LogitsProcessor]] = [
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
]

LogitsProcessorSpec = str | type[LogitsProcessor]


def _check_class(obj: object, where: str) -> type[LogitsProcessor]:
    if not isinstance(obj, type):
        raise ValueError(f"{where}: loaded object {obj!r} is not a class")
    if not issubclass(obj, LogitsProcessor):
        raise ValueError(f"{where}: {obj.__qualname__} is not a subclass of LogitsProcessor")
    return obj


def load_entry_point_classes() -> list[type[LogitsProcessor]]:
    """Classes registered under the ``raydecode.logits_processors`` entry-point group."""
    classes = []
    for ep in entry_points(group=LOGITSPROCS_GROUP):
        where = f"logits-processor entry point {ep.name!r} ({ep.value})"
        try:
            obj = ep.load()
        except Exception as exc:
            raise RuntimeError(f"{where}: failed to load: {exc}") from exc
        classes.append(_check_class(obj, where))
    return classes


def load_class(spec: LogitsProcessorSpec, position: int = 0) -> type[LogitsProcessor]:
    """One processor class from a class object or a ``"module.path:Qual.name"`` string."""
    where = f"logits processor #{position} ({spec!r})"
    if isinstance(spec, type):
        return _check_class(spec, where)
    if not isinstance(spec, str):
        raise ValueError(f"{where}: expected a class or a 'module:Qualname' string")
    parts = spec.split(":")
    if len(parts) != 2:
        raise ValueError(
            f"{where}: expected exactly one ':' between module and class "
            f"('module.path:ClassName'), found {len(parts) - 1}"
        )
    module_path, qualname = (p.strip() for p in parts)
    if not module_path or not qualname:
        raise ValueError(f"{where}: module path and class name must both be non-empty")
    try:
        obj: object = importlib.import_module(module_path)
    except Exception as exc:
        raise RuntimeError(f"{where}: cannot import module {module_path!r}: {exc}") from exc
    for attr in qualname.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as exc:
            raise ValueError(f"{where}: {module_path!r} has no attribute {qualname!r}") from exc
    return _check_class(obj, where)


def load_custom_classes(
    custom: Sequence[LogitsProcessorSpec] = (),
) -> list[type[LogitsProcessor]]:
    """Entry-point classes, then the configured ones; a class listed twice loads once."""
    classes: list[type[LogitsProcessor]] = []
    for cls in load_entry_point_classes() + [load_class(s, i) for i, s in enumerate(custom)]:
        if cls not in classes and cls not in BUILTIN_LOGITS_PROCESSORS:
            classes.append(cls)
    return classes


def build_logitsprocs(
    config: SamplerConfig,
    device: torch.device | str = "cpu",
    is_pin_memory: bool = False,
    custom_logitsprocs: Sequence[LogitsProcessorSpec] | None = None,
) -> LogitsProcessors:
    """Instantiates the built-ins, the entry-point processors and the configured ones
    (``custom_logitsprocs``, defaulting to ``config.logits_processors``)."""
    device = torch.device(device)
    if custom_logitsprocs is None:
        custom_logitsprocs = config.logits_processors
    classes = BUILTIN_LOGITS_PROCESSORS + load_custom_classes(custom_logitsprocs)
    return LogitsProcessors(cls(config, device, is_pin_memory) for cls in classes)


def validate_request_params(logitsprocs: LogitsProcessors, params: SamplingParams) -> None:
    """Each loaded processor's ``validate_params`` on one request's params."""
    for cls in {type(p) for p in logitsprocs.all}:
        cls.validate_params(params)
