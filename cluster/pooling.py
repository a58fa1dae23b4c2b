"""Pooling requests on the driver: ``PoolingParams``, the outputs (vLLM's names and
shapes), and what the driver does to a worker's raw vector per request.

A worker answers a pooling model's request with one raw vector (``worker/pooling.py``:
the pooled hidden state through a sentence-transformers folder's Dense layers, or a
classification head's logits). Per request the driver then applies what vLLM's pooler
applies: an embedding is cut to ``dimensions`` (Matryoshka models) and normalised, a
classification gets its activation (the model's: softmax over several labels, sigmoid
over one, or what its ``problem_type`` or cross-encoder config names), unless ``use_activation`` is False (vLLM 0.32's one switch for both: its ``normalize``
is gone) or, left unset, the model's folder says otherwise (a sentence-transformers
folder without a Normalize module). A score is a cross-encoder's activated logit, or the
cosine similarity of two embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import numpy as np
import torch

from worker.pooling import PoolerSpec

#: vLLM's pooling tasks a request may name
POOLING_TASKS = ("embed", "classify", "score")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A pooling request's options (vLLM's ``PoolingParams``); ``ValueError`` naming
    the field for a bad value (checked again against the model by ``verify``)."""

    #: keep only this many prompt tokens (the first ones; -1: ``max_model_len``); None: a
    #: prompt longer than the model's length is an error
    truncate_prompt_tokens: int | None = None
    #: embed: the first this many values (a Matryoshka model's); None: all
    dimensions: int | None = None
    #: embed: normalise the vector; classify / score: the activation (softmax, or
    #: sigmoid for one label); None: the model's default (on, unless its
    #: sentence-transformers folder has no Normalize module)
    use_activation: bool | None = None
    #: what the request is for (set by the method that makes it: ``LLM.embed`` -> embed)
    task: str | None = None

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, got {t!r}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be true or false, got {self.use_activation!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}")

    def clone(self, **changes: Any) -> PoolingParams:
        out = msgspec.structs.replace(self, **changes)
        out.__post_init__()
        return out

    def verify(self, pooler: PoolerSpec) -> None:
        """Refuses what the model cannot do, naming the field."""
        task = self.task or ("embed" if pooler.task == "embed" else "classify")
        supported = pooler.supported_tasks
        if task not in supported:
            raise ValueError(f"task {task!r} is not supported by this model (it supports {supported})")
        if self.dimensions is not None:
            if pooler.task != "embed":
                raise ValueError("dimensions applies to embeddings only")
            dims = pooler.matryoshka_dimensions
            if not pooler.is_matryoshka and not dims:
                raise ValueError(f"dimensions: the model does not support Matryoshka embeddings; dimensions must be "
                                 f"unset (received dimensions={self.dimensions})")
            if self.dimensions > pooler.width:
                raise ValueError(f"dimensions: the model only supports dimensions in range [1, {pooler.width}], "
                                 f"got {self.dimensions}")
            if dims and self.dimensions not in dims:
                raise ValueError(f"dimensions: the model only supports Matryoshka dimensions {dims}, got "
                                 f"{self.dimensions}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def finish_vector(raw: np.ndarray, params: PoolingParams, pooler: PoolerSpec) -> np.ndarray:
    """A worker's raw vector as the request asked for it (float32)."""
    v = np.asarray(raw, dtype=np.float32)
    if pooler.task == "embed":
        if params.dimensions is not None:
            v = v[: params.dimensions]
        if params.use_activation if params.use_activation is not None else pooler.use_activation:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v
    if not (params.use_activation if params.use_activation is not None else pooler.use_activation):
        return v
    kind = pooler.activation
    if kind == "identity":
        return v
    if kind == "tanh":
        return np.tanh(v).astype(np.float32)
    if kind == "sigmoid" or len(v) == 1:
        return (1.0 / (1.0 + np.exp(-v))).astype(np.float32)
    e = np.exp(v - v.max())
    return (e / e.sum()).astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine similarity of two vectors (0 where one is all zeros)."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.dot(a, b) / (na * nb)) if na and nb else 0.0


# -- outputs (vLLM's classes) ------------------------------------------------------------


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's ``PoolingOutput.data``)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool
    #: set when the request ended with an error (or was aborted)
    error: str | None = None
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class _TaskRequestOutput:
    """A pooling output as one task's output class shows it (``from_base``)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    #: the task's output class, built from the vector as a list
    task_output: ClassVar[type] = object

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> Any:
        return cls(out.request_id, cls.task_output(_data(out).tolist()), out.prompt_token_ids, out.finished)


@dataclass
class EmbeddingRequestOutput(_TaskRequestOutput):
    outputs: EmbeddingOutput
    task_output: ClassVar[type] = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(_TaskRequestOutput):
    outputs: ClassificationOutput
    task_output: ClassVar[type] = ClassificationOutput


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def _data(out: PoolingRequestOutput) -> torch.Tensor:
    if out.outputs is None:
        raise RuntimeError(f"request {out.request_id}: {out.error or 'no output'}")
    return out.outputs.data
