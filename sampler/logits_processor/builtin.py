"""Built-in processors: min-p, logit bias, min tokens, and the dict-state helper."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from sampler.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

if TYPE_CHECKING:
    from sampler.config import SamplerConfig
    from sampler.params import SamplingParams

T = TypeVar("T")


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Applies a BatchUpdate to sparse per-row state ``{row: entry}``.

    ``new_state(params, prompt_ids, output_ids)`` builds an added row's entry, or None
    when the processor does not apply to it. Returns True if the dict changed.
    """
    if not batch_update:
        return False
    updated = False
    for index in batch_update.removed:
        if req_entries.pop(index, None) is not None:
            updated = True
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    if req_entries:
        for a, b, direction in batch_update.moved:
            a_entry = req_entries.pop(a, None)
            b_entry = req_entries.pop(b, None)
            if a_entry is not None:
                req_entries[b] = a_entry
                updated = True
            if b_entry is not None:
                updated = True
                if direction == MoveDirectionality.SWAP:
                    req_entries[a] = b_entry
    return updated


def _index_tensor(data: Sequence[int], device: torch.device, pin: bool) -> torch.Tensor:
    cpu = torch.tensor(data, dtype=torch.int64, device="cpu")
    if torch.device(device).type == "cpu":
        return cpu
    return (cpu.pin_memory() if pin else cpu).to(device, non_blocking=True)


class MinPLogitsProcessor(LogitsProcessor):
    """Masks tokens whose probability is below ``min_p`` times the row's top probability.

    Argmax-invariant. The per-row thresholds live in a CPU array (numpy view) and, on
    an accelerator, are copied to a device buffer only when they changed.
    """

    #: Its masks depend on the params only (not on the tokens generated so far).
    reads_output_token_ids = False

    def __init__(self, config: SamplerConfig, device: torch.device, is_pin_memory: bool):
        max_rows = config.max_num_seqs
        self.min_p_count = 0
        self.min_p_cpu_tensor = torch.zeros(max_rows, dtype=torch.float32)
        if is_pin_memory and torch.device(device).type != "cpu":
            self.min_p_cpu_tensor = self.min_p_cpu_tensor.pin_memory()
        self.min_p_cpu = self.min_p_cpu_tensor.numpy()
        self.use_double_tensor = torch.device(device).type != "cpu"
        self.min_p_device = (
            torch.empty(max_rows, dtype=torch.float32, device=device)
            if self.use_double_tensor
            else self.min_p_cpu_tensor
        )
        self.min_p: torch.Tensor = self.min_p_device[:0].unsqueeze(1)

    def is_argmax_invariant(self) -> bool:
        return True

    def get_min_p_by_index(self, index: int) -> float:
        return float(self.min_p_cpu[index])

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        cpu = self.min_p_cpu
        before = cpu.copy() if self.min_p_count or batch_update.added else None
        for index in batch_update.removed:
            cpu[index] = 0.0
        for index, params, _, _ in batch_update.added:
            cpu[index] = params.min_p
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                cpu[a], cpu[b] = cpu[b], cpu[a]
            else:
                cpu[b] = cpu[a]
                cpu[a] = 0.0
        size = batch_update.batch_size
        cpu[size:] = 0.0  # rows past the batch are empty after condensing
        self.min_p_count = int(np.count_nonzero(cpu[:size]))
        changed = before is None or not np.array_equal(before[:size], cpu[:size])
        if self.min_p_count and (changed or self.min_p.shape[0] != size):
            view = self.min_p_device[:size]
            if self.use_double_tensor:
                view.copy_(self.min_p_cpu_tensor[:size], non_blocking=True)
            self.min_p = view.unsqueeze(1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.min_p_count:
            return logits
        if self.min_p_count * 2 > logits.shape[0]:
            return self._mask(logits, self.min_p)
        # Few rows use min-p: work on those rows only.
        rows = self.min_p[:, 0].nonzero().squeeze(1)
        logits[rows] = self._mask(logits[rows], self.min_p[rows])
        return logits

    @staticmethod
    def _mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """Masks tokens below ``min_p`` times the top probability. Compared in log space:
        ``p_i < min_p * p_max`` is ``logit_i < logit_max + log(min_p)``."""
        top = logits.amax(dim=-1, keepdim=True)
        logits.masked_fill_(logits < top + min_p.log(), float("-inf"))
        return logits


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds each request's ``logit_bias`` to its row; one scatter-add per step."""

    reads_output_token_ids = False

    def __init__(self, config: SamplerConfig, device: torch.device, is_pin_memory: bool):
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory
        self.biases: dict[int, dict[int, float]] = {}
        self.bias_tensor = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.logits_slice = (
            _index_tensor([], self.device, False),
            _index_tensor([], self.device, False),
        )

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(
            self.biases, batch_update, lambda params, _p, _o: params.logit_bias or None
        ):
            return
        rows: list[int] = []
        toks: list[int] = []
        vals: list[float] = []
        for row, bias in self.biases.items():
            rows.extend([row] * len(bias))
            toks.extend(bias.keys())
            vals.extend(bias.values())
        self.bias_tensor = torch.tensor(vals, dtype=torch.float32).to(self.device)
        self.logits_slice = (
            _index_tensor(rows, self.device, self.pin_memory),
            _index_tensor(toks, self.device, self.pin_memory),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.biases:
            logits.index_put_(self.logits_slice, self.bias_tensor, accumulate=True)
        return logits


class MinTokensLogitsProcessor(LogitsProcessor):
    """Bans a request's stop tokens (EOS included) until it has ``min_tokens`` outputs.

    Keeps a reference to each request's live output list, so the length check needs no
    per-step input; rows that reached their minimum are dropped in ``update_state``.
    """

    def __init__(self, config: SamplerConfig, device: torch.device, is_pin_memory: bool):
        self.device = torch.device(device)
        self.pin_memory = is_pin_memory
        self.min_toks: dict[int, tuple[int, Sequence[int], list[int]]] = {}
        self.logits_slice = (
            _index_tensor([], self.device, False),
            _index_tensor([], self.device, False),
        )
        self.neg_inf_tensor = torch.tensor(float("-inf"), dtype=torch.float32, device=self.device)

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def add_request(
        params: SamplingParams, _prompt_ids: list[int] | None, output_ids: list[int]
    ) -> tuple[int, Sequence[int], list[int]] | None:
        stop_ids = sorted(params.all_stop_token_ids)
        if params.min_tokens and stop_ids and len(output_ids) < params.min_tokens:
            return params.min_tokens, output_ids, stop_ids
        return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self.min_toks, batch_update, self.add_request)
        done = [row for row, (n, out, _) in self.min_toks.items() if len(out) >= n]
        for row in done:
            del self.min_toks[row]
        if not (changed or done):
            return
        rows: list[int] = []
        toks: list[int] = []
        for row, (_, _, stop_ids) in self.min_toks.items():
            rows.extend([row] * len(stop_ids))
            toks.extend(stop_ids)
        self.logits_slice = (
            _index_tensor(rows, self.device, self.pin_memory),
            _index_tensor(toks, self.device, self.pin_memory),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits.index_put_(self.logits_slice, self.neg_inf_tensor)
        return logits

    def apply_at_positions(
        self, logits: torch.Tensor, row_index: Sequence[int], num_prior: Sequence[int]
    ) -> torch.Tensor:
        """Logits row i belongs to batch row ``row_index[i]`` and comes ``num_prior[i]``
        draft tokens after that row's output, so the ban holds while
        ``len(output) + num_prior[i] < min_tokens``."""
        if not self.min_toks:
            return logits
        rows: list[int] = []
        toks: list[int] = []
        for i, (row, prior) in enumerate(zip(row_index, num_prior)):
            entry = self.min_toks.get(int(row))
            if entry is not None and len(entry[1]) + int(prior) < entry[0]:
                rows.extend([i] * len(entry[2]))
                toks.extend(entry[2])
        if rows:
            index = (
                torch.tensor(rows, dtype=torch.long, device=logits.device),
                torch.tensor(toks, dtype=torch.long, device=logits.device),
            )
            logits.index_put_(index, self.neg_inf_tensor.to(logits.device))
        return logits
