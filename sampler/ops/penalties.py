"""Repetition, frequency and presence penalties, touching only the tokens that occur.

The work is O(tokens in the batch): the (row, token) pairs of the prompts and outputs
are deduplicated with numpy, and only those logits are gathered, changed and written
back; nothing walks the whole ``[rows, vocab]`` tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


def pair_keys(token_lists: Sequence[Sequence[int]], rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """``row * vocab + token`` for every token of the listed rows (with repeats)."""
    lists = [token_lists[r] for r in rows.tolist()]
    lengths = np.fromiter((len(t) for t in lists), dtype=np.int64, count=len(lists))
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=total)
    return np.repeat(rows.astype(np.int64) * vocab_size, lengths) + flat


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]] | None,
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: np.ndarray,
    frequency_penalties: np.ndarray,
    presence_penalties: np.ndarray,
) -> torch.Tensor:
    """In place on ``logits [rows, vocab]`` (all per-row inputs indexed like its rows).

    Repetition (tokens in the prompt or the output): positive logits are divided by the
    penalty, the others multiplied. Then ``frequency * count`` and ``presence`` (once)
    are subtracted for tokens in the output.
    """
    vocab = logits.shape[1]
    device = logits.device
    rep_rows = np.flatnonzero(repetition_penalties != 1.0)
    if rep_rows.size:
        keys = pair_keys(output_token_ids, rep_rows, vocab)
        if prompt_token_ids is not None:
            keys = np.concatenate([keys, pair_keys(prompt_token_ids, rep_rows, vocab)])
        seen = torch.from_numpy(np.unique(keys)).to(device)
        r, t = seen // vocab, seen % vocab
        values = logits[r, t]
        penalty = torch.from_numpy(repetition_penalties).to(device)[r]
        logits[r, t] = torch.where(values > 0, values / penalty, values * penalty)
    freq_rows = np.flatnonzero((frequency_penalties != 0) | (presence_penalties != 0))
    if freq_rows.size:
        keys, counts = np.unique(pair_keys(output_token_ids, freq_rows, vocab), return_counts=True)
        if keys.size:
            keys_t = torch.from_numpy(keys).to(device)
            r, t = keys_t // vocab, keys_t % vocab
            freq = torch.from_numpy(frequency_penalties).to(device)[r]
            pres = torch.from_numpy(presence_penalties).to(device)[r]
            delta = freq * torch.from_numpy(counts).to(device, torch.float32) + pres
            logits.index_put_((r, t), -delta, accumulate=True)
    return logits
