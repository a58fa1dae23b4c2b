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

from sampler.ops.topk import topk

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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top ``width`` candidates of each row with top-k and top-p applied; whether they
    were enough (top-k rows unless a tie at the k-th value runs past them; top-p rows if
    they hold p of the mass); and the mass they hold."""
    vocab = row_logits.shape[1]
    vals, ids = topk(row_logits, width, sorted=True)
    kth = vals.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
    has_k = k < vocab
    # (A -inf k-th value means every finite token is already a candidate.)
    ties_cut = has_k & (vals[:, -1:] >= kth).squeeze(1) & torch.isfinite(kth).squeeze(1)
    ties_cut &= width < vocab
    vals = vals.masked_fill(vals < kth, float("-inf"))
    # Mass of each candidate: within the top-k set when the row has top-k, else within
    # the whole vocabulary (so that we can tell whether the candidates cover p).
    norm = torch.where(has_k, torch.logsumexp(vals, dim=-1), lse).unsqueeze(1)
    probs = (vals - norm).exp()
    cum = probs.cumsum(dim=-1)
    covered = ((has_k | (cum[:, -1] >= p)) & ~ties_cut) | (width >= vocab)
    drop = (cum - probs) >= p.unsqueeze(1)
    drop[:, 0] = False
    return ids, vals.masked_fill(drop, float("-inf")), covered, cum[:, -1]


HISTOGRAM_BINS = 4096
HISTOGRAM_SPAN = 40.0  # nats below the row's top logit that the bins cover


def _top_p_by_histogram(
    row_logits: torch.Tensor, lse: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact top-p for rows without top-k, in O(vocab): bin the logits below the row's
    top, find the bin where the mass from the top crosses p, and sort only that bin's
    tokens. Rows crossing in the catch-all bottom bin or in a crowded bin come back as
    not covered."""
    rows, vocab = row_logits.shape
    device = row_logits.device
    top = row_logits.amax(dim=-1, keepdim=True)
    scale = HISTOGRAM_BINS / HISTOGRAM_SPAN
    bins = (top - row_logits).mul_(scale).clamp_(max=HISTOGRAM_BINS - 1).long()
    probs = (row_logits - lse.unsqueeze(1)).exp_()
    mass = torch.zeros(rows, HISTOGRAM_BINS, device=device).scatter_add_(1, bins, probs)
    count = torch.zeros(rows, HISTOGRAM_BINS, device=device).scatter_add_(
        1, bins, torch.ones(1, device=device).expand(rows, vocab)
    )
    cum = mass.double().cumsum(dim=-1)
    target = p.double().unsqueeze(1)
    crossing = torch.searchsorted(cum, target).clamp_(max=HISTOGRAM_BINS - 1)
    before = cum.gather(1, crossing) - mass.gather(1, crossing).double()
    in_bin_count = count.gather(1, crossing).squeeze(1)
    ok = (crossing.squeeze(1) < HISTOGRAM_BINS - 1) & (in_bin_count <= vocab // 4)
    width = max(int(in_bin_count[ok].max()) if bool(ok.any()) else 1, 1)
    vals, _ = row_logits.masked_fill(bins != crossing, float("-inf")).topk(width, dim=-1)
    vals_probs = (vals.double() - lse.double().unsqueeze(1)).exp()
    keep = (before + vals_probs.cumsum(dim=-1) - vals_probs) < target
    keep[:, 0] = True  # the crossing bin holds the token that reaches p
    keep &= torch.isfinite(vals)  # padding past the bin's own tokens
    cut = vals.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    ids = torch.arange(vocab, device=device).expand(rows, vocab)
    return ids, row_logits.masked_fill(row_logits < cut, float("-inf")), ok


def truncate_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> list[Candidates]:
    """Candidate lists for the rows that truncate (``top_k < vocab`` or ``top_p < 1``).

    ``top_k`` holds the vocabulary size for rows without top-k; ``top_p`` holds 1.0 for
    rows without top-p. Rows start with ``CANDIDATE_WIDTHS[0]`` candidates and go wider
    while they are not covered; a top-p-only row whose first candidates hold less than
    half of p goes straight to the O(vocab) histogram (for vocabularies larger than its
    bins), and the last resort is a sort of the whole row. Each row's path depends on its own logits only, so results do not
    depend on the rest of the batch. Returns one group per path used.
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
        lse[no_k] = torch.logsumexp(row_logits if bool(no_k.all()) else row_logits[no_k], dim=-1)
    max_k = int(k[~no_k].max()) if not bool(no_k.all()) else 0
    widths = sorted({min(vocab, max(w, max_k)) for w in CANDIDATE_WIDTHS})

    def add(index: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        done = ok.nonzero().squeeze(1)
        if done.numel():
            groups.append(Candidates(rows[index[done]], ids[done], vals[done]))
        return index[~ok]

    left = torch.arange(rows.numel(), device=logits.device)
    to_histogram = left[:0]
    for width in widths:
        if left.numel() == 0 or width >= vocab:
            break
        sub = row_logits if left.numel() == row_logits.shape[0] else row_logits[left]
        ids, vals, covered, held = _truncate(sub, lse[left], k[left], p[left], width)
        jump = ~covered & no_k[left] & (held < p[left] / 2)
        to_histogram = torch.cat([to_histogram, left[jump]])
        add(left, ids, vals, covered)
        left = left[~covered & ~jump]
    if vocab <= HISTOGRAM_BINS:  # a sort of the whole row is cheaper than the bins
        left = torch.cat([to_histogram, left])
        hist = left[:0]
    else:
        hist = torch.cat([to_histogram, left[no_k[left]]])
        left = left[~no_k[left]]
    if hist.numel():
        ids, vals, ok = _top_p_by_histogram(row_logits[hist], lse[hist], p[hist])
        left = torch.cat([left, add(hist, ids, vals, ok)])
    if left.numel():
        ids, vals, covered, _ = _truncate(row_logits[left], lse[left], k[left], p[left], vocab)
        add(left, ids, vals, covered)
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
