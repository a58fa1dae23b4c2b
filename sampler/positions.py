"""Positions: which batch row, and which draft prefix, each logits row belongs to.

The sampler's logits are one row per batch row, except under speculative decoding:
there each row's drafts add logits rows that follow its output plus a prefix of its
drafts. The sampler, the rejection sampler and the thinking budget all place their
per-row state by these positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Positions:
    """Logits rows that are not one-per-batch-row: row ``i`` belongs to batch row
    ``row_index[i]`` and follows that row's output plus the draft tokens
    ``prefixes[i]`` (speculative decoding)."""

    row_index: np.ndarray
    prefixes: list[list[int]]

    @classmethod
    def bonus(cls, spec_token_ids: Sequence[Sequence[int]], num_rows: int) -> Positions:
        prefixes = [list(spec_token_ids[i]) if i < len(spec_token_ids) else [] for i in range(num_rows)]
        return cls(np.arange(num_rows), prefixes)

    @classmethod
    def drafts(cls, draft_token_ids: Sequence[Sequence[int]]) -> Positions:
        rows: list[int] = []
        prefixes: list[list[int]] = []
        for row, drafts in enumerate(draft_token_ids):
            for j in range(len(drafts)):
                rows.append(row)
                prefixes.append(list(drafts[:j]))
        return cls(np.asarray(rows, dtype=np.int64), prefixes)

    @property
    def is_one_per_row(self) -> bool:
        """Logits row i is batch row i (the bonus layout)."""
        return bool((self.row_index == np.arange(len(self.row_index))).all())

    def past_tokens(self, outputs: Sequence[Sequence[int]]) -> list[list[int]]:
        return [list(outputs[r]) + p for r, p in zip(self.row_index.tolist(), self.prefixes)]
