"""Top-k / top-p truncation and sampling, without sorting whole vocabularies.

Rows that truncate work on a candidate list: the row's ``W`` largest logits (``W`` is
64, or 1024, and at least the largest ``k``). Top-k keeps every candidate
whose logit is >= the k-th largest (ties at the k-th value kept); top-p keeps candidates,
in descending order, while the probability mass before them is < p (so the most likely
token is always kept). A top-p row whose W candidates hold less than p of the mass is
redone wider, at worst over its whole vocabulary. Sampling is inverse-CDF with one uniform per row, so a
seeded row draws exactly one number from its own generator per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Candidate widths tried in turn before a row falls back to its whole vocabulary.
CANDIDATE_WIDTHS = (64, 1024)
#: Block size of the two-level inverse-CDF sampler.
SAMPLE_BLOCK = 1024


@dataclass
class Candidates:
    """Truncated rows: ``rows`` index the input; ``token_ids``/``logits`` are ``[n, W]``,
    sorted by logit, with removed candidates at -inf."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    logits: torch.Tensor


def _truncate(
    row_logits: torch.Tensor, lse: torch.Tensor, k: torch.Tensor, p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top ``width`` candidates of each row with top-k and top-p applied; also whether
    they were enough (top-k rows always are; top-p rows if they hold p of the mass)."""
    vocab = row_logits.shape[1]
    vals, ids = row_logits.topk(width, dim=-1, sorted=True)
    kth = vals.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
    # A tie at the k-th value may continue past the candidates: then go wider.
    ties_cut = (vals[:, -1:] >= kth).squeeze(1) & (width < vocab)
    vals = vals.masked_fill(vals < kth, float("-inf"))
    # Mass of each candidate: within the top-k set when the row has top-k, else within
    # the whole vocabulary (so that we can tell whether the candidates cover p).
    has_k = k < vocab
    norm = torch.where(has_k, torch.logsumexp(vals, dim=-1), lse).unsqueeze(1)
    probs = (vals - norm).exp()
    cum = probs.cumsum(dim=-1)
    covered = ((has_k | (cum[:, -1] >= p)) & ~ties_cut) | (width >= vocab)
    drop = (cum - probs) >= p.unsqueeze(1)
    drop[:, 0] = False
    return ids, vals.masked_fill(drop, float("-inf")), covered


def truncate_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> list[Candidates]:
    """Candidate lists for the rows that truncate (``top_k < vocab`` or ``top_p < 1``).

    ``top_k`` holds the vocabulary size for rows without top-k; ``top_p`` holds 1.0 for
    rows without top-p. Widths grow in tiers (``CANDIDATE_WIDTHS``, then the whole
    vocabulary) for the top-p rows whose candidates did not hold p of the mass; the
    result has one group per tier used.
    """
    vocab = logits.shape[1]
    n = logits.shape[0]
    k = top_k if top_k is not None else torch.full((n,), vocab, dtype=torch.long)
    p = top_p if top_p is not None else torch.ones(n, dtype=torch.float32)
    k = k.to(logits.device).long()
    p = p.to(logits.device).float()
    rows = ((k < vocab) | (p < 1.0)).nonzero().squeeze(1)
    groups: list[Candidates] = []
    if rows.numel() == 0:
        return groups
    k, p = k[rows], p[rows]
    row_logits = logits if rows.numel() == n else logits[rows]
    no_k = k >= vocab
    lse = torch.zeros(rows.numel(), device=logits.device)
    if bool(no_k.any()):
        lse[no_k] = torch.logsumexp(row_logits[no_k] if not bool(no_k.all()) else row_logits, dim=-1)
    max_k = int(k[~no_k].max()) if not bool(no_k.all()) else 0
    widths = sorted({min(vocab, max(w, max_k)) for w in CANDIDATE_WIDTHS} | {vocab})
    left = torch.arange(rows.numel(), device=logits.device)
    for width in widths:
        sub = row_logits if left.numel() == row_logits.shape[0] else row_logits[left]
        ids, vals, covered = _truncate(sub, lse[left], k[left], p[left], width)
        done = covered.nonzero().squeeze(1)
        if done.numel():
            groups.append(Candidates(rows[left[done]], ids[done], vals[done]))
        left = left[~covered]
        if left.numel() == 0:
            break
    return groups


def scatter_candidates(logits: torch.Tensor, groups: list[Candidates]) -> torch.Tensor:
    """Writes the truncation into full rows: everything but the kept candidates -inf."""
    for g in groups:
        full = torch.full((g.rows.numel(), logits.shape[1]), float("-inf"), device=logits.device)
        full.scatter_(1, g.token_ids, g.logits)
        logits[g.rows] = full
    return logits


def inverse_cdf_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of ``softmax(logits)`` chosen by ``uniforms`` in [0, 1).

    Two levels keep it exact without a float64 copy of the vocabulary: pick a block of
    ``SAMPLE_BLOCK`` tokens by the cumulative block masses (accumulated in float64), then
    the token inside the block.
    """
    probs = torch.softmax(logits, dim=-1)
    rows, vocab = probs.shape
    if vocab <= 4 * SAMPLE_BLOCK:
        return _pick(probs.double(), uniforms.double().unsqueeze(1))
    n_full = vocab // SAMPLE_BLOCK
    # float32 sums of 1024 values are exact to ~1e-6 relative; the running sum over
    # blocks is float64.
    block_mass = probs[:, : n_full * SAMPLE_BLOCK].view(rows, n_full, SAMPLE_BLOCK).sum(dim=-1)
    if vocab % SAMPLE_BLOCK:
        tail = probs[:, n_full * SAMPLE_BLOCK :].sum(dim=-1, keepdim=True)
        block_mass = torch.cat([block_mass, tail], dim=1)
    block_mass = block_mass.double()
    cdf = block_mass.cumsum(dim=-1)
    target = uniforms.double().unsqueeze(1) * cdf[:, -1:]
    block = _search(cdf, target)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(target))
    offsets = block * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=probs.device)
    inside = probs.gather(1, offsets.clamp(max=vocab - 1)).double()
    inside = inside.masked_fill(offsets >= vocab, 0.0)
    return (block * SAMPLE_BLOCK + _pick(inside, target - before).unsqueeze(1)).squeeze(1)


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose cdf exceeds ``target``, never past the last index with mass
    (rounding can put the target at the total)."""
    index = torch.searchsorted(cdf, target, right=True)
    last_with_mass = (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)
    return torch.minimum(index, last_with_mass)


def _pick(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Index per row where the running sum of ``probs`` passes ``target [rows, 1]``
    (``target`` is an absolute mass, not a fraction)."""
    cdf = probs.cumsum(dim=-1)
    return _search(cdf, target.clamp(max=cdf[:, -1:])).squeeze(1)
