"""Repetition, frequency and presence penalties, O(tokens in the batch) to build."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[rows, vocab]`` counts of each token id in each row's list (one scatter-add)."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.int32, device=device)
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    total = int(lengths.sum())
    if total:
        flat = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total)
        rows = np.repeat(np.arange(len(token_lists), dtype=np.int64), lengths)
        counts.index_put_(
            (torch.from_numpy(rows).to(device), torch.from_numpy(flat).to(device)),
            torch.ones(total, dtype=torch.int32, device=device),
            accumulate=True,
        )
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_counts: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """In place on ``logits [rows, vocab]``.

    Repetition (tokens seen in the prompt or the output): positive logits are divided
    by the penalty, the others multiplied. Then frequency (times the output count) and
    presence (once if in the output) are subtracted.
    """
    output_mask = output_counts > 0
    seen = output_mask if prompt_mask is None else (output_mask | prompt_mask)
    rep = repetition_penalties.unsqueeze(1)
    factor = torch.where(logits > 0, 1.0 / rep, rep)
    logits.copy_(torch.where(seen, logits * factor, logits))
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    return logits
