"""The Sampler: logits in, one token per row (and its logprobs) out.

``Sampler.forward`` is the order of operations, top to bottom.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from sampler.config import LogprobsMode, SamplerConfig
from sampler.logits_processor.interface import LogitsProcessor, LogitsProcessorError
from sampler.metadata import SamplingMetadata
from sampler.ops.bad_words import apply_bad_words
from sampler.ops.penalties import apply_penalties
from sampler.ops.topk import topk
from sampler.ops.topk_topp import (
    Candidates,
    inverse_cdf_sample,
    scatter_candidates,
    truncate_top_k_top_p,
)
from sampler.positions import Positions


@dataclass
class LogprobsTensors:
    """Per row: the sampled token first, then the top-k (``[rows, k + 1]``), and the
    sampled token's rank (the number of tokens with logprob >= its own)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64
    logprobs_tensors: LogprobsTensors | None = None
    #: Rows whose constraints banned every token (e.g. bad words covering all allowed
    #: tokens). They were sampled unconstrained so nothing crashes; finish them with an
    #: error.
    unsatisfiable_rows: list[int] = field(default_factory=list)
    #: Rows whose logits held NaN or +inf (a broken model, or parameters that overflow
    #: float32): sampled from a uniform row instead, so NaN never reaches sampling;
    #: finish them with an error too.
    nonfinite_rows: list[int] = field(default_factory=list)


def compute_logprobs(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 log-softmax over the vocabulary, into ``out`` when given."""
    if out is None:
        return logits.log_softmax(dim=-1, dtype=torch.float32)
    return torch.log_softmax(logits.float(), dim=-1, out=out)


class Sampler:
    """Samples one token per row with vLLM V1 semantics.

    Usable standalone: ``Sampler(config)(logits, SamplingMetadata.from_requests(...))``.
    """

    def __init__(
        self,
        config: SamplerConfig | None = None,
        logprobs_mode: LogprobsMode | None = None,
        *,
        in_place: bool = False,
    ) -> None:
        """``in_place=True`` lets the sampler edit float32 logits it is given instead of
        copying them first (the worker's setting: its logits are not reused)."""
        self.config = config
        self.in_place = in_place
        # Room for one [rows, vocab] float32 copy (the raw logprobs), kept between steps:
        # a fresh tensor that size is page-faulted in on every step (tens of MB at a
        # 150k vocabulary), which costs more than the log-softmax itself.
        self._workspace: torch.Tensor | None = None
        self.logprobs_mode: LogprobsMode = logprobs_mode or (
            config.logprobs_mode if config is not None else "raw_logprobs"
        )

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if md.num_rows == 0:
            return SamplerOutput(sampled_token_ids=torch.empty(0, dtype=torch.long))
        positions = (
            Positions.bonus(md.spec_token_ids, md.num_rows)
            if md.spec_token_ids and any(md.spec_token_ids)
            else None
        )
        # 1. float32 logits (a copy unless in_place: the caller's tensor is left alone).
        logits = logits.to(torch.float32, copy=not self.in_place)
        # 2. raw logprobs / logits, before anything touches them.
        raw = None
        if md.max_num_logprobs is not None and self.logprobs_mode.startswith("raw"):
            out = self._scratch(logits)
            raw = compute_logprobs(logits, out) if self.logprobs_mode == "raw_logprobs" else out.copy_(logits)
        # 3-7. allowed tokens, bad words, non-argmax-invariant processors, penalties,
        #      thinking-budget forcing.
        logits = self.apply_constraints(logits, md, positions)
        # 8. greedy rows take the argmax of the constrained logits (the same pass finds
        #    rows left with no usable logit: see release_unusable_rows).
        top, greedy = logits.max(dim=-1)
        unsatisfiable, nonfinite = release_unusable_rows(logits, top)
        if unsatisfiable or nonfinite:
            greedy[unsatisfiable + nonfinite] = 0
        if md.all_random:
            greedy = None
        if md.all_greedy:
            sampled = greedy
        else:
            # 9. temperature; 10. argmax-invariant processors (min-p); 11. top-k, top-p.
            logits = self.apply_temperature(logits, md.temperature, positions)
            logits = apply_processors(md.logitsprocs.argmax_invariant, logits, md, positions)
            groups = truncate_top_k_top_p(logits, md.top_k, md.top_p)
            # 12. sample (seeded rows with their own generator); greedy rows keep argmax.
            sampled = self.sample_random(logits, groups, md)
            if greedy is not None:
                sampled = torch.where(md.greedy_mask, greedy, sampled)
            if md.max_num_logprobs is not None and raw is None and groups:
                logits = scatter_candidates(logits, groups)
        logprobs_tensors = None
        if md.max_num_logprobs is not None:
            if raw is None:
                raw = (
                    compute_logprobs(logits, self._scratch(logits))
                    if self.logprobs_mode == "processed_logprobs" else logits
                )
            logprobs_tensors = gather_logprobs(raw, md.max_num_logprobs, sampled)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs_tensors=logprobs_tensors,
            unsatisfiable_rows=unsatisfiable,
            nonfinite_rows=nonfinite,
        )

    __call__ = forward

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A float32 tensor shaped like ``like`` from the kept workspace (valid until the
        next call: nothing built from it may outlive the step)."""
        rows, vocab = like.shape
        ws = self._workspace
        if ws is None or ws.shape[0] < rows or ws.shape[1] != vocab or ws.device != like.device:
            ws = self._workspace = torch.empty(max(rows, ws.shape[0] if ws is not None else 0), vocab,
                                               dtype=torch.float32, device=like.device)
        return ws[:rows]

    # -- the steps --------------------------------------------------------------------

    def apply_constraints(
        self, logits: torch.Tensor, md: SamplingMetadata, positions: Positions | None
    ) -> torch.Tensor:
        """Everything that may change the argmax, in order: allowed_token_ids, bad words,
        non-argmax-invariant processors, penalties, thinking-budget forcing."""
        rows = None if positions is None else torch.from_numpy(positions.row_index).to(logits.device)
        past = None
        if positions is not None and (md.bad_words_token_ids or not md.no_penalties):
            past = positions.past_tokens(md.output_token_ids)
        if md.allowed_token_ids_mask is not None:
            mask = md.allowed_token_ids_mask if rows is None else md.allowed_token_ids_mask[rows]
            logits.masked_fill_(mask, float("-inf"))
        if md.bad_words_token_ids:
            if positions is None:
                apply_bad_words(logits, md.bad_words_token_ids, md.output_token_ids)
            else:
                per_row = {
                    i: md.bad_words_token_ids[r]
                    for i, r in enumerate(positions.row_index.tolist())
                    if r in md.bad_words_token_ids
                }
                apply_bad_words(logits, per_row, past)
        logits = apply_processors(md.logitsprocs.non_argmax_invariant, logits, md, positions)
        if not md.no_penalties:
            if positions is None:
                apply_penalties(
                    logits, md.prompt_token_ids, md.output_token_ids,
                    md.repetition_penalties, md.frequency_penalties, md.presence_penalties,
                )
            else:
                at = positions.row_index
                prompts = None if md.prompt_token_ids is None else [
                    md.prompt_token_ids[r] for r in at.tolist()
                ]
                apply_penalties(
                    logits, prompts, past, md.repetition_penalties[at],
                    md.frequency_penalties[at], md.presence_penalties[at],
                )
        if md.thinking_budget is not None and md.thinking_budget.has_tracked_requests():
            if positions is None:
                md.thinking_budget.apply_at_positions(logits, range(logits.shape[0]))
            else:
                md.thinking_budget.apply_at_positions(
                    logits, positions.row_index.tolist(), positions.prefixes
                )
        return logits

    @staticmethod
    def apply_temperature(
        logits: torch.Tensor, temperature: torch.Tensor, positions: Positions | None
    ) -> torch.Tensor:
        if positions is not None:
            temperature = temperature[torch.from_numpy(positions.row_index).to(logits.device)]
        return logits.div_(temperature.unsqueeze(1))

    @staticmethod
    def sample_random(
        logits: torch.Tensor, groups: list[Candidates], md: SamplingMetadata
    ) -> torch.Tensor:
        """Inverse-CDF sampling of every row; truncated rows sample their candidates."""
        uniforms = draw_uniforms(logits.shape[0], md.generators, logits.device)
        sampled = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        free = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        for g in groups:
            picked = inverse_cdf_sample(g.logits, uniforms[g.rows])
            sampled[g.rows] = g.token_ids.gather(1, picked.unsqueeze(1)).squeeze(1)
            free[g.rows] = False
        free_rows = free.nonzero().squeeze(1)
        if free_rows.numel():
            if free_rows.numel() == logits.shape[0]:
                sampled = inverse_cdf_sample(logits, uniforms)
            else:
                sampled[free_rows] = inverse_cdf_sample(logits[free_rows], uniforms[free_rows])
        return sampled


def release_unusable_rows(
    logits: torch.Tensor, row_max: torch.Tensor | None = None
) -> tuple[list[int], list[int]]:
    """Rows with no finite logit left (their constraints ban everything) and rows with
    a NaN or +inf logit are reset to a uniform row, so that the batch samples without
    NaNs; returns ``(unsatisfiable rows, non-finite rows)``. ``row_max`` is
    ``logits.amax(-1)`` when the caller already has it (a NaN anywhere in a row makes
    its max NaN, so the row maximum sees every bad row)."""
    if row_max is None:
        row_max = logits.amax(dim=-1)
    bad = (~torch.isfinite(row_max)).nonzero().squeeze(1)
    if bad.numel() == 0:
        return [], []
    logits[bad] = 0.0
    dead = torch.isneginf(row_max[bad])
    return bad[dead].tolist(), bad[~dead].tolist()


def draw_uniforms(n: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """``[n]`` uniforms in [0, 1): each seeded row draws one from its own generator, the
    other rows from the global one."""
    uniforms = torch.rand(n, device=device)
    for row, gen in generators.items():
        if row < n:
            uniforms[row] = torch.rand(1, generator=gen, device=device)[0]
    return uniforms


def apply_processors(
    processors: Iterable[LogitsProcessor],
    logits: torch.Tensor,
    md: SamplingMetadata,
    positions: Positions | None,
) -> torch.Tensor:
    """Runs processors on one-row-per-batch-row logits, or, for speculative positions,
    once per draft depth on a batch-shaped view whose output lists are temporarily
    extended with the draft prefix (so processors see the tokens before the position).
    A processor whose ``reads_output_token_ids`` is False skips that on the bonus layout
    (one row per batch row): the drafts cannot change what it does. A processor with
    ``apply_at_positions(logits, row_index, num_prior)`` handles the positions itself;
    with ``reads_draft_tokens = True`` it also gets the draft prefixes themselves (a
    fourth argument: ``prefixes[i]`` are the drafts before logits row i)."""
    for proc in processors:
        try:
            if positions is None or (
                positions.is_one_per_row and not getattr(proc, "reads_output_token_ids", True)
            ):
                logits = proc.apply(logits)
            elif hasattr(proc, "apply_at_positions"):
                num_prior = np.fromiter((len(p) for p in positions.prefixes), np.int64)
                if getattr(proc, "reads_draft_tokens", False):  # it needs the drafts themselves
                    logits = proc.apply_at_positions(
                        logits, positions.row_index, num_prior, positions.prefixes
                    )
                else:
                    logits = proc.apply_at_positions(logits, positions.row_index, num_prior)
            else:
                logits = _apply_by_depth(proc, logits, md, positions)
        except LogitsProcessorError:
            raise
        except Exception as exc:
            raise LogitsProcessorError(proc, exc) from exc
    return logits


def _apply_by_depth(
    proc: LogitsProcessor, logits: torch.Tensor, md: SamplingMetadata, positions: Positions
) -> torch.Tensor:
    depth = np.fromiter((len(p) for p in positions.prefixes), np.int64, len(positions.prefixes))
    for d in np.unique(depth).tolist():
        sel = np.flatnonzero(depth == d)
        batch_rows = positions.row_index[sel]
        sel_t = torch.from_numpy(sel).to(logits.device)
        rows_t = torch.from_numpy(batch_rows).to(logits.device)
        view = torch.zeros(md.num_rows, logits.shape[1], dtype=logits.dtype, device=logits.device)
        view[rows_t] = logits[sel_t]
        extended = []
        for i, r in zip(sel.tolist(), batch_rows.tolist()):
            if positions.prefixes[i]:
                md.output_token_ids[r].extend(positions.prefixes[i])
                extended.append((r, len(positions.prefixes[i])))
        try:
            view = proc.apply(view)
        finally:
            for r, n in extended:
                del md.output_token_ids[r][-n:]
        logits[sel_t] = view[rows_t]
    return logits


def gather_logprobs(source: torch.Tensor, k: int, sampled: torch.Tensor) -> LogprobsTensors:
    """The sampled token's value and rank, then the top-``k`` values, per row.

    The rank (tokens with a value >= the sampled one's) is read off the top-k when the
    sampled token beats the k-th value; only the other rows count over the vocabulary.
    """
    sampled = sampled.long()
    sampled_values = source.gather(1, sampled.unsqueeze(1))
    if k > 0:
        top_values, top_ids = topk(source, k)
        ranks = (top_values >= sampled_values).sum(dim=-1)
        # A value at or below the k-th may have equals or betters past the top-k.
        full = (sampled_values[:, 0] <= top_values[:, -1]).nonzero().squeeze(1)
    else:
        top_values = source.new_empty(source.shape[0], 0)
        top_ids = sampled.new_empty(source.shape[0], 0)
        ranks = torch.zeros(source.shape[0], dtype=torch.long, device=source.device)
        full = torch.arange(source.shape[0], device=source.device)
    if full.numel():
        ranks[full] = (source[full] - sampled_values[full]).ge_(0).sum(dim=-1).long()
    return LogprobsTensors(
        token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled_values, top_values], dim=1),
        ranks=ranks,
    )
