"""The logits-processor contract: BatchUpdate, MoveDirectionality, LogitsProcessor."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sampler.config import SamplerConfig
    from sampler.params import SamplingParams


class MoveDirectionality(Enum):
    #: row a moves to row b; row a becomes empty, whatever was at b is discarded
    UNIDIRECTIONAL = auto()
    #: rows a and b exchange their requests
    SWAP = auto()


#: (row, params, prompt token ids, output token ids). The output list is the
#: request's live list: processors that keep it see every token appended later.
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
#: (row a, row b, directionality)
MovedRequest = tuple[int, int, MoveDirectionality]
#: the row of a request removed without replacement
RemovedRequest = int


@dataclass(frozen=True)
class BatchUpdate:
    """The changes of the persistent batch in one step.

    Apply in this order: ``removed``, then ``added`` (row indices as they were before
    any move), then ``moved`` in list order. ``batch_size`` is the number of rows after
    the whole update.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits transformation with per-row state.

    Built as ``Cls(config, device, is_pin_memory)``. ``update_state`` is called before
    every step (``None`` when the batch did not change); ``apply`` gets the
    ``[batch_size, vocab_size]`` float32 logits and returns them (in place is fine).
    """

    #: Whether ``apply`` depends on the requests' output token lists. Processors that
    #: only read params may say False: under speculative decoding the sampler then
    #: skips re-running them for each draft depth.
    reads_output_token_ids: bool = True
    #: Under speculative decoding a processor may define
    #: ``apply_at_positions(logits, row_index, num_prior)`` (logits row i follows batch
    #: row ``row_index[i]``'s output plus ``num_prior[i]`` drafts) instead of being run
    #: once per draft depth; with ``reads_draft_tokens = True`` the sampler also passes
    #: the drafts before each position (``prefixes[i]``, a fourth argument).
    reads_draft_tokens: bool = False

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` if a request's params are unusable by this processor.

        Called at submission, before the request is scheduled.
        """
        return None

    @abstractmethod
    def __init__(
        self, config: SamplerConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor never changes a row's argmax (then it may be skipped
        for an all-greedy batch and is applied after temperature)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        raise NotImplementedError


class LogitsProcessorError(RuntimeError):
    """A processor raised while applying; names it so the worker can fail the affected
    requests and keep serving."""

    def __init__(self, processor: object, cause: BaseException) -> None:
        self.processor_name = type(processor).__qualname__
        super().__init__(f"logits processor {self.processor_name} failed: {cause!r}")
