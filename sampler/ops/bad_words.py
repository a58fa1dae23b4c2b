"""Bad words: ban the token that would complete a banned token sequence."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def apply_bad_words(
    logits: torch.Tensor,
    bad_words_token_ids: Mapping[int, Sequence[Sequence[int]]],
    past_tokens: Sequence[Sequence[int]],
) -> torch.Tensor:
    """``bad_words_token_ids[i]`` are the banned sequences of logits row ``i``; a
    sequence's last token is banned when the row's past tokens end with the rest of it
    (a one-token sequence is always banned)."""
    rows: list[int] = []
    toks: list[int] = []
    for i, sequences in bad_words_token_ids.items():
        past = past_tokens[i]
        for seq in sequences:
            prefix_len = len(seq) - 1
            if prefix_len == 0 or (
                len(past) >= prefix_len and list(past[len(past) - prefix_len :]) == list(seq[:-1])
            ):
                rows.append(i)
                toks.append(seq[-1])
    if rows:
        logits[
            torch.tensor(rows, dtype=torch.long, device=logits.device),
            torch.tensor(toks, dtype=torch.long, device=logits.device),
        ] = float("-inf")
    return logits
