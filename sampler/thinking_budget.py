"""Thinking budget: force the end of a reasoning block after a number of tokens.

Per tracked request a small automaton reads the token stream (the prompt first, then
each confirmed output token):

* outside a block, the think-start sequence opens one (count = 0);
* inside, each token counts, until the think-end sequence closes the block;
* once ``count`` reaches the request's budget, the end sequence is forced one token
  per position (``end[0]``, then ``end[1]``, ...), so multi-token end sequences work;
  a budget of 0 forces the end right after the start sequence.

A prompt that already opened a block (its last start sequence comes after its last
end sequence) starts inside it, with the prompt tokens after the start counted.
Requests without ``thinking_token_budget`` are not tracked and never touched.

Speculative decoding: the state at draft position ``j`` is the confirmed state advanced
over ``drafts[:j]``. So with ``remaining = budget - count`` and ``k`` drafts, forcing
starts at position 0 if ``remaining <= 0``, at ``remaining`` if ``remaining < k``, else
at the bonus position.

The sampler calls ``apply_at_positions`` (a logits row, the batch row it belongs to,
the drafts before it); ``apply_to_logits`` is vLLM's entry point, which lays the same
positions out from the drafts and hands them to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import numpy as np
import torch

from sampler.logits_processor.interface import BatchUpdate, MoveDirectionality
from sampler.positions import Positions


class ReasoningConfig(msgspec.Struct, kw_only=True):
    """The token sequences that open and close a reasoning block."""

    reasoning_start_token_ids: list[int]
    reasoning_end_token_ids: list[int]

    def __post_init__(self) -> None:
        for name in ("reasoning_start_token_ids", "reasoning_end_token_ids"):
            ids = getattr(self, name)
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{name} must be a non-empty list of token ids, got {ids!r}")

    @classmethod
    def from_strings(cls, start: str, end: str, tokenizer: Any) -> ReasoningConfig:
        """Tokenizes the start/end markers (e.g. "<think>", "</think>")."""
        start_ids = list(tokenizer.encode(start, add_special_tokens=False))
        end_ids = list(tokenizer.encode(end, add_special_tokens=False))
        if not start_ids or not end_ids:
            raise ValueError(
                f"the tokenizer turns the reasoning markers {start!r}/{end!r} into no tokens"
            )
        return cls(reasoning_start_token_ids=start_ids, reasoning_end_token_ids=end_ids)


@dataclass
class _ThinkState:
    budget: int
    in_think: bool = False
    count: int = 0  # thinking tokens since the start sequence
    forced: int = 0  # end tokens forced so far in the current forcing run
    tail: list[int] = field(default_factory=list)  # last tokens seen, for matching
    consumed: int = 0  # confirmed output tokens already read
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()


class ThinkingBudgetStateHolder:
    """Per-row thinking-budget state that follows the persistent batch.

    The constructor takes vLLM's arguments; the state is a dict of rows on the host, so
    ``max_num_seqs``, ``num_spec_tokens``, ``device`` and ``is_pin_memory`` size or place
    nothing (forcing edits the logits on their own device)."""

    def __init__(
        self,
        reasoning_config: ReasoningConfig | None,
        max_num_seqs: int,
        num_spec_tokens: int,
        device: torch.device | str,
        is_pin_memory: bool,
    ) -> None:
        self.is_enabled = reasoning_config is not None
        self.think_start_token_ids: list[int] = (
            list(reasoning_config.reasoning_start_token_ids) if reasoning_config else []
        )
        self.think_end_token_ids: list[int] = (
            list(reasoning_config.reasoning_end_token_ids) if reasoning_config else []
        )
        self._tail_len = max(len(self.think_start_token_ids), len(self.think_end_token_ids), 1)
        self._state: dict[int, _ThinkState] = {}

    # -- batch bookkeeping ----------------------------------------------------------

    def has_tracked_requests(self) -> bool:
        return bool(self._state)

    def sync_batch(self, batch_update: BatchUpdate | None) -> None:
        """Follows the batch's removes, adds and moves (in that order)."""
        if not self.is_enabled or not batch_update:
            return
        for index in batch_update.removed:
            self._state.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            budget = params.thinking_token_budget
            if budget is None:
                self._state.pop(index, None)
            else:
                self._state[index] = self._initial_state(prompt_ids or [], budget, output_ids)
        for a, b, direction in batch_update.moved:
            state_a = self._state.pop(a, None)
            state_b = self._state.pop(b, None)
            if state_a is not None:
                self._state[b] = state_a
            if direction == MoveDirectionality.SWAP and state_b is not None:
                self._state[a] = state_b

    def update_state(
        self,
        output_token_ids: Sequence[Sequence[int]],
        spec_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Reads each tracked row's newest tokens.

        ``output_token_ids[row]`` is the row's output list; when ``spec_token_ids[row]``
        is non-empty, the list ends with those draft tokens (vLLM's layout), and they are
        kept apart from the confirmed tokens.
        """
        if not self.is_enabled or not self._state:
            return
        specs = spec_token_ids or []
        for row, state in self._state.items():
            if row >= len(output_token_ids):
                continue
            output = output_token_ids[row]
            num_drafts = len(specs[row]) if row < len(specs) else 0
            if num_drafts and len(output) >= num_drafts:
                output = output[: len(output) - num_drafts]
            state.output = output
            self._advance(state)

    # -- the automaton --------------------------------------------------------------

    def _initial_state(
        self, prompt_ids: Sequence[int], budget: int, output: Sequence[int]
    ) -> _ThinkState:
        state = _ThinkState(budget=budget, prompt=prompt_ids, output=output)
        last_start = _find_last(prompt_ids, self.think_start_token_ids)
        last_end = _find_last(prompt_ids, self.think_end_token_ids)
        if last_start > last_end:
            state.in_think = True
            state.count = len(prompt_ids) - (last_start + len(self.think_start_token_ids))
        state.tail = list(prompt_ids[-self._tail_len :])
        return state

    def _step(self, state: _ThinkState, token: int) -> None:
        state.tail.append(token)
        del state.tail[: -self._tail_len]
        if not state.in_think:
            if _ends_with(state.tail, self.think_start_token_ids):
                state.in_think, state.count, state.forced = True, 0, 0
        elif _ends_with(state.tail, self.think_end_token_ids):
            state.in_think, state.count, state.forced = False, 0, 0
        elif state.count >= state.budget:
            state.forced += 1
            if state.forced >= len(self.think_end_token_ids):
                state.in_think, state.count, state.forced = False, 0, 0
        else:
            state.count += 1

    def _forced_token(self, state: _ThinkState) -> int | None:
        if state.in_think and state.count >= state.budget:
            return self.think_end_token_ids[min(state.forced, len(self.think_end_token_ids) - 1)]
        return None

    def _advance(self, state: _ThinkState) -> None:
        output = state.output
        if len(output) < state.consumed:  # the output was rewound: replay from the prompt
            fresh = self._initial_state(state.prompt, state.budget, output)
            state.__dict__.update(fresh.__dict__)
        for token in output[state.consumed :]:
            self._step(state, int(token))
        state.consumed = len(output)

    def forced_token_at(self, row: int, prefix: Sequence[int] = ()) -> int | None:
        """The token row ``row`` must emit after its confirmed output plus ``prefix``
        (draft tokens), or None when it is free."""
        state = self._state.get(row)
        if state is None:
            return None
        self._advance(state)
        if prefix:
            state = replace(state, tail=list(state.tail))
            for token in prefix:
                self._step(state, int(token))
        return self._forced_token(state)

    # -- applying -------------------------------------------------------------------

    def apply_at_positions(
        self,
        logits: torch.Tensor,
        row_index: Sequence[int],
        prefixes: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Forces rows: logits row ``i`` belongs to batch row ``row_index[i]`` and comes
        after that row's confirmed output plus ``prefixes[i]``. A forced row keeps only
        its forced token (logit 0, all others -inf)."""
        if not self.is_enabled or not self._state:
            return logits
        rows: list[int] = []
        tokens: list[int] = []
        for i, row in enumerate(row_index):
            if row in self._state:
                tok = self.forced_token_at(row, prefixes[i] if prefixes else ())
                if tok is not None:
                    rows.append(i)
                    tokens.append(tok)
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[index] = float("-inf")
            logits[index, torch.tensor(tokens, dtype=torch.long, device=logits.device)] = 0.0
        return logits

    def apply_to_logits(
        self,
        logits: torch.Tensor,
        predict_bonus_token: bool,
        spec_token_ids: Sequence[Sequence[int]] | None,
    ) -> torch.Tensor:
        """vLLM's layout. Without drafts: one logits row per batch row. With drafts and
        ``predict_bonus_token`` False: ``len(spec_token_ids[i])`` rows for batch row i
        (its draft positions), row after row. With ``predict_bonus_token`` True: one row
        per batch row, at the bonus position after all of its drafts. The positions are
        the sampler's own (``Positions``), forced by ``apply_at_positions``."""
        if not self.is_enabled or not self._state:
            return logits
        specs = spec_token_ids or []
        if not any(specs):
            return self.apply_at_positions(logits, range(logits.shape[0]))
        at = Positions.bonus(specs, logits.shape[0]) if predict_bonus_token else Positions.drafts(specs)
        return self.apply_at_positions(logits, at.row_index.tolist(), at.prefixes)


def _ends_with(seq: Sequence[int], suffix: Sequence[int]) -> bool:
    n = len(suffix)
    return n > 0 and len(seq) >= n and list(seq[-n:]) == list(suffix)


def _find_last(seq: Sequence[int], pattern: Sequence[int]) -> int:
    """Start index of the last occurrence of ``pattern`` in ``seq``, or -1."""
    n = len(pattern)
    if n == 0 or len(seq) < n:
        return -1
    arr = np.asarray(seq)
    hits = np.flatnonzero(arr[: len(arr) - n + 1] == pattern[0])
    for start in hits[::-1]:
        if list(arr[start : start + n]) == list(pattern):
            return int(start)
    return -1
