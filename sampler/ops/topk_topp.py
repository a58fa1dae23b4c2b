"""Top-k / top-p truncation and sampling, without sorting whole vocabularies.

Rows that truncate work on a candidate list: the row's ``W`` largest logits (``W`` is at
least ``CANDIDATE_WIDTH`` and at least the largest ``k``). Top-k keeps every candidate
whose logit is >= the k-th largest (ties at the k-th value kept); top-p keeps candidates,
in descending order, while the probability mass before them is < p (so the most likely
token is always kept). A top-p row whose W candidates hold less than p of the mass is
redone over its whole vocabulary. Sampling is inverse-CDF with one uniform per row, so a
seeded row draws exactly one number from its own generator per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CANDIDATE_WIDTH = 1024


@dataclass
class Candidates:
    """Truncated rows: ``rows`` index the input; ``token_ids``/``logits`` are ``[n, W]``,
    sorted by logit, with removed candidates at -inf."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    logits: torch.Tensor


def _truncate(
    logits: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, p: torch.Tensor, width: int
) -> tuple[Candidates, torch.Tensor]:
    row_logits = logits[rows]
    vals, ids = row_logits.topk(width, dim=-1, sorted=True)
    kth = vals.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
    vals = vals.masked_fill(vals < kth, float("-inf"))
    # Mass of each candidate: within the top-k set when the row has top-k, else within
    # the whole vocabulary (so that we can tell whether W candidates cover p).
    has_k = k < logits.shape[1]
    norm = torch.where(
        has_k, torch.logsumexp(vals, dim=-1), torch.logsumexp(row_logits, dim=-1)
    ).unsqueeze(1)
    probs = (vals - norm).exp()
    cum = probs.cumsum(dim=-1)
    covered = has_k | (cum[:, -1] >= p) | (width >= logits.shape[1])
    drop = (cum - probs) >= p.unsqueeze(1)
    drop[:, 0] = False
    vals = vals.masked_fill(drop, float("-inf"))
    return Candidates(rows, ids, vals), covered


def truncate_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> list[Candidates]:
    """Candidate lists for the rows that truncate (``top_k < vocab`` or ``top_p < 1``).

    ``top_k`` holds the vocabulary size for rows without top-k; ``top_p`` holds 1.0 for
    rows without top-p. Returns up to two groups (the second: rows redone at full width).
    """
    vocab = logits.shape[1]
    n = logits.shape[0]
    k = top_k if top_k is not None else torch.full((n,), vocab, dtype=torch.long)
    p = top_p if top_p is not None else torch.ones(n, dtype=torch.float32)
    k = k.to(logits.device).long()
    p = p.to(logits.device).float()
    restricted = (k < vocab) | (p < 1.0)
    rows = restricted.nonzero().squeeze(1)
    if rows.numel() == 0:
        return []
    width = min(vocab, max(CANDIDATE_WIDTH, int(k[rows].max())))
    group, covered = _truncate(logits, rows, k[rows], p[rows], width)
    if bool(covered.all()):
        return [group]
    keep = covered.nonzero().squeeze(1)
    redo = (~covered).nonzero().squeeze(1)
    full, _ = _truncate(logits, rows[redo], k[rows[redo]], p[rows[redo]], vocab)
    kept = Candidates(group.rows[keep], group.token_ids[keep], group.logits[keep])
    return [kept, full]


def scatter_candidates(logits: torch.Tensor, groups: list[Candidates]) -> torch.Tensor:
    """Writes the truncation into full rows: everything but the kept candidates -inf."""
    for g in groups:
        full = torch.full((g.rows.numel(), logits.shape[1]), float("-inf"), device=logits.device)
        full.scatter_(1, g.token_ids, g.logits)
        logits[g.rows] = full
    return logits


def inverse_cdf_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of ``softmax(logits)`` chosen by ``uniforms`` in [0, 1)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float64)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = uniforms.to(cdf.dtype).unsqueeze(1) * total
    index = torch.searchsorted(cdf, target, right=True)
    # Rounding can put the target at the total; the last token with mass is the one
    # where the cdf first reaches the total.
    last_with_mass = (cdf < total).sum(dim=-1, keepdim=True)
    return torch.minimum(index, last_with_mass).squeeze(1)
