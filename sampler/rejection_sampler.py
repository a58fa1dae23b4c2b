"""Rejection sampling for speculative decoding (Leviathan et al., 2023).

For each row with drafts ``d_0..d_{k-1}`` the target model scored every draft position.
Greedy rows accept drafts while they equal the target argmax; the first mismatch emits
the argmax instead and stops. Random rows accept ``d_j`` with probability
``min(1, p(d_j) / q(d_j))`` (``q`` is the draft distribution, a point mass on ``d_j`` for
draft-free proposers such as n-gram lookup); the first rejection emits a token drawn
from ``normalize(max(p - q, 0))`` and stops. A row that accepts every draft also emits
its bonus token. The emitted tokens then follow the target distribution exactly.

The target logits go through the same constraints and transforms as in the Sampler,
each position seeing its row's output plus the drafts before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sampler.config import SamplerConfig
from sampler.metadata import SamplingMetadata
from sampler.ops.topk_topp import inverse_cdf_sample, scatter_candidates, truncate_top_k_top_p
from sampler.positions import Positions
from sampler.sampler import Sampler, apply_processors, release_unusable_rows

PLACEHOLDER_TOKEN_ID = -1


class RejectionSampler:
    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = config
        self.sampler = Sampler(config)

    def forward(
        self,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Returns ``[rows, max_spec_len + 1]`` emitted tokens, -1 where none."""
        md = metadata
        device = target_logits.device
        num_rows = len(draft_token_ids)
        counts = [len(d) for d in draft_token_ids]
        num_drafts = sum(counts)
        max_spec = max(counts, default=0)
        if target_logits.shape[0] != num_drafts:
            raise ValueError(
                f"target_logits has {target_logits.shape[0]} rows for {num_drafts} draft tokens"
            )
        if draft_probs is not None and draft_probs.shape != target_logits.shape:
            raise ValueError("draft_probs must have the shape of target_logits")
        positions = Positions.drafts(draft_token_ids)
        rows = torch.from_numpy(positions.row_index).to(device)
        drafts = torch.tensor(
            [t for d in draft_token_ids for t in d], dtype=torch.long, device=device
        )
        logits = self.sampler.apply_constraints(
            target_logits.to(torch.float32, copy=True), md, positions
        )
        release_unusable_rows(logits)  # the worker fails those requests anyway
        greedy_rows = md.greedy_mask[rows] if num_drafts else torch.zeros(0, dtype=torch.bool)

        accepted = torch.zeros(num_drafts, dtype=torch.bool, device=device)
        replacement = torch.zeros(num_drafts, dtype=torch.long, device=device)
        if not md.all_random and num_drafts:
            argmax = logits.argmax(dim=-1)
            accepted = torch.where(greedy_rows, drafts == argmax, accepted)
            replacement = torch.where(greedy_rows, argmax, replacement)
        if not md.all_greedy and num_drafts:
            probs = self._target_probs(logits, md, positions, rows)
            p_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
            if draft_probs is None:
                q_draft = torch.ones_like(p_draft)
                residual = probs.clone()
                residual.scatter_(1, drafts.unsqueeze(1), 0.0)
            else:
                q = draft_probs.to(torch.float32)
                q_draft = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
                residual = (probs - q).clamp_(min=0.0)
            # p == q leaves no residual mass; rejection then has probability 0 anyway.
            empty = residual.sum(dim=-1) <= 0
            residual[empty] = probs[empty]
            u_accept, u_recover = self._uniforms(counts, md, device)
            # u < min(1, p/q); a draft its own proposer gave no mass is rejected.
            accept_random = (q_draft > 0) & (u_accept * q_draft < p_draft)
            recovered = inverse_cdf_sample(residual.log(), u_recover)
            accepted = torch.where(greedy_rows, accepted, accept_random)
            replacement = torch.where(greedy_rows, replacement, recovered)

        out = torch.full((num_rows, max_spec + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
        if num_drafts:
            col = torch.cat([torch.arange(c, device=device) for c in counts if c])
            acc = torch.zeros(num_rows, max_spec, dtype=torch.bool, device=device)
            acc[rows, col] = accepted
            # Accepted prefix length: drafts up to the first rejection.
            prefix = acc.long().cumprod(dim=1).sum(dim=1)
            grid_drafts = torch.full_like(acc, PLACEHOLDER_TOKEN_ID, dtype=torch.long)
            grid_drafts[rows, col] = drafts
            grid_repl = torch.full_like(grid_drafts, PLACEHOLDER_TOKEN_ID)
            grid_repl[rows, col] = replacement
            keep = torch.arange(max_spec, device=device).unsqueeze(0) < prefix.unsqueeze(1)
            out[:, :max_spec] = torch.where(keep, grid_drafts, out[:, :max_spec])
            counts_t = torch.tensor(counts, device=device)
            rejected = prefix < counts_t
            rej_rows = rejected.nonzero().squeeze(1)
            out[rej_rows, prefix[rej_rows]] = grid_repl[rej_rows, prefix[rej_rows]]
            full = (~rejected).nonzero().squeeze(1)
            out[full, counts_t[full]] = bonus_token_ids.to(device).long()[full]
        else:
            out[:, 0] = bonus_token_ids.to(device).long()
        return out

    __call__ = forward

    def _target_probs(
        self, logits: torch.Tensor, md: SamplingMetadata, positions: Positions, rows: torch.Tensor
    ) -> torch.Tensor:
        """Target distribution at each draft position: temperature, argmax-invariant
        processors, then top-k/top-p, as the Sampler does for random rows."""
        logits = self.sampler.apply_temperature(logits, md.temperature, positions)
        logits = apply_processors(md.logitsprocs.argmax_invariant, logits, md, positions)
        top_k = None if md.top_k is None else md.top_k[rows]
        top_p = None if md.top_p is None else md.top_p[rows]
        groups = truncate_top_k_top_p(logits, top_k, top_p)
        if groups:
            logits = scatter_candidates(logits, groups)
        return torch.softmax(logits, dim=-1)

    @staticmethod
    def _uniforms(
        counts: list[int], md: SamplingMetadata, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two uniforms per draft position (accept, recover). A seeded row with ``k``
        drafts draws exactly ``2 * k`` numbers from its own generator, so its result
        does not depend on the rest of the batch."""
        total = sum(counts)
        accept = torch.rand(total, device=device)
        recover = torch.rand(total, device=device)
        start = 0
        for row, c in enumerate(counts):
            gen = md.generators.get(row)
            if gen is not None and c:
                drawn = torch.rand(2 * c, generator=gen, device=device)
                accept[start : start + c] = drawn[:c]
                recover[start : start + c] = drawn[c:]
            start += c
        return accept, recover
