"""Top-k along the vocabulary that reads each row once and sorts only a small part.

``torch.topk`` on CPU selects within the whole row; for a small ``k`` against a large
vocabulary most of that work is wasted. Here the row is cut into blocks of ``b``
tokens: one ``amax`` pass gives every block's maximum, the ``k`` blocks with the largest
maxima are gathered (``k * b`` tokens), and ``torch.topk`` runs on those.

Exact in values: let ``T`` be the ``k``-th largest block maximum. Every token above ``T``
sits in a block whose maximum is above ``T``, so in a chosen block; and the chosen
blocks' maxima are ``k`` tokens at or above ``T``. So the ``k`` largest candidates have
the same values as the ``k`` largest tokens of the row; only which of several tied
tokens is returned may differ (``torch.topk`` does not specify that either).
"""

from __future__ import annotations

import math

import torch

#: Smallest block: ``amax`` over shorter blocks costs more than the blocks save.
MIN_BLOCK = 64


def block_size(vocab: int, k: int) -> int | None:
    """About sqrt(vocab / k) (so the block maxima and the candidates are of one size),
    a power of two; None when blocking does not pay (``torch.topk`` is used)."""
    if k <= 0 or vocab < 4096:
        return None
    size = max(MIN_BLOCK, 1 << max(0, int(math.log2(math.sqrt(vocab / k)))))
    if vocab // size < 4 * k:
        return None
    return size


def topk(x: torch.Tensor, k: int, *, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1, sorted=sorted)`` for a 2-D ``x``: (values, indices)."""
    if x.dim() != 2:
        raise ValueError(f"topk takes [rows, vocab], got {tuple(x.shape)}")
    rows, vocab = x.shape
    size = block_size(vocab, k)
    if size is None or rows == 0 or x.stride(1) != 1:
        return x.topk(k, dim=-1, sorted=sorted)
    num_blocks = vocab // size
    body = x[:, : num_blocks * size].view(rows, num_blocks, size)
    chosen = body.amax(dim=-1).topk(k, dim=-1, sorted=False).indices  # [rows, k]
    cand_vals = body[torch.arange(rows, device=x.device).unsqueeze(1), chosen].reshape(rows, k * size)
    cand_ids = (chosen.unsqueeze(2) * size + torch.arange(size, device=x.device)).reshape(rows, k * size)
    if num_blocks * size < vocab:  # the ragged tail is always a candidate
        cand_vals = torch.cat([cand_vals, x[:, num_blocks * size :]], dim=1)
        tail = torch.arange(num_blocks * size, vocab, device=x.device).expand(rows, -1)
        cand_ids = torch.cat([cand_ids, tail], dim=1)
    vals, pos = cand_vals.topk(k, dim=-1, sorted=sorted)
    return vals, cand_ids.gather(1, pos)
