"""AdapterLogitsProcessor: wraps per-request callables as a batch-level processor."""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from sampler.logits_processor.builtin import process_dict_updates
from sampler.logits_processor.interface import BatchUpdate, LogitsProcessor

if TYPE_CHECKING:
    from sampler.config import SamplerConfig
    from sampler.params import SamplingParams

#: ``(output_ids, logits_row) -> logits_row`` or
#: ``(prompt_ids, output_ids, logits_row) -> logits_row``
RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """Base for processors written per request.

    Subclasses implement ``new_req_logits_processor(params)`` returning a callable (or
    None when the request does not use it) and ``is_argmax_invariant``. The callable
    gets the request's live output list (and its prompt when it takes three
    arguments) and the row's logits; it may edit the row in place or return a new one.
    Rows are handled one by one, so keep adapters for rare, per-request logic.
    """

    def __init__(self, config: SamplerConfig, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(
        self, params: SamplingParams
    ) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(
        self,
        params: SamplingParams,
        prompt_ids: list[int] | None,
        output_ids: list[int],
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        if len(inspect.signature(req_lp).parameters) == 3:
            if prompt_ids is None:
                raise ValueError(
                    f"{type(self).__name__}: this per-request processor takes the prompt "
                    "token ids, but none were given"
                )
            return partial(req_lp, prompt_ids, output_ids)
        return partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, req_lp in self.req_info.items():
            row_logits = logits[row]
            new_logits = req_lp(row_logits)
            if new_logits is not row_logits:
                logits[row] = new_logits
        return logits
