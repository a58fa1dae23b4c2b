"""Prompt-lookup (n-gram) drafting for speculative decoding.

For a row whose tokens end with an n-gram that occurred earlier in the row (prompt or
output), the tokens that followed its latest earlier occurrence are the drafts. Longer
n-grams are tried first.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_spec_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.k = num_spec_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, limit: int | None = None) -> np.ndarray:
        """Up to ``min(k, limit)`` draft tokens continuing ``tokens`` (may be empty)."""
        k = self.k if limit is None else min(self.k, limit)
        length = len(tokens)
        if k <= 0 or length < 2:
            return tokens[:0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Windows that start before the suffix itself, so a match has a follower.
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k]
        return tokens[:0]
