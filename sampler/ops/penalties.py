"""Repetition, frequency and presence penalties, touching only the tokens that occur.

The work is O(tokens in the batch), without sorting: the (row, token) pairs of the
prompts and outputs become flat indices into the logits, and only those logits are
gathered, changed and written back; nothing walks the whole ``[rows, vocab]`` tensor.
A pair that occurs several times needs no deduplication: the once-only changes
(repetition, presence) compute every copy's new value from the same gathered original
and write it back (the same value wherever the pair repeats), and the frequency penalty
is added once per occurrence.
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
    if not logits.is_contiguous():
        return logits.copy_(apply_penalties(
            logits.contiguous(), prompt_token_ids, output_token_ids,
            repetition_penalties, frequency_penalties, presence_penalties,
        ))
    vocab = logits.shape[1]
    device = logits.device
    flat = logits.view(-1)
    rep_rows = np.flatnonzero(repetition_penalties != 1.0)
    if rep_rows.size:
        keys = pair_keys(output_token_ids, rep_rows, vocab)
        if prompt_token_ids is not None:
            keys = np.concatenate([keys, pair_keys(prompt_token_ids, rep_rows, vocab)])
        if keys.size:
            keys_t = torch.from_numpy(keys).to(device)
            values = flat[keys_t]
            penalty = torch.from_numpy(repetition_penalties).to(device)[keys_t // vocab]
            flat[keys_t] = torch.where(values > 0, values / penalty, values * penalty)
    freq_rows = np.flatnonzero((frequency_penalties != 0) | (presence_penalties != 0))
    if freq_rows.size:
        keys = pair_keys(output_token_ids, freq_rows, vocab)
        if keys.size:
            keys_t = torch.from_numpy(keys).to(device)
            r = keys_t // vocab
            flat[keys_t] = flat[keys_t] - torch.from_numpy(presence_penalties).to(device)[r]
            flat.index_add_(0, keys_t, -torch.from_numpy(frequency_penalties).to(device)[r])
    return logits
