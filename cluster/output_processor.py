"""Merges a worker's reply into the sequences of the step it answers.

The reply is flat arrays (tokens per row, the tokens, logprob matrices, prompt-logprob
chunks); the logprob matrices become lists once per reply, and each row's slice goes to
its sequence in one call, which appends the tokens, detokenizes them, checks the stop
rules and appends each position to the ``FlatLogprobs`` with a few list extends. Nothing
is built per token beyond the token text that logprobs carry.
"""

from __future__ import annotations

import time

import numpy as np

from cluster.request import Request
from cluster.scheduler import ScheduledStep
from worker import StepReply


def apply_reply(step: ScheduledStep, reply: StepReply) -> list[Request]:
    """Returns the requests that changed (the caller frees finished sequences)."""
    now = time.time()
    changed: dict[int, Request] = {}
    failed = {f.row: f.message for f in reply.failed}
    num_sampled = reply.num_sampled.numpy()
    num_drafts = reply.num_draft_tokens.numpy()
    tokens = reply.sampled_token_ids.numpy()
    width = reply.logprobs_width
    # One conversion per reply; each row then takes plain list slices.
    lp_ids = reply.logprob_token_ids.numpy().reshape(-1, width).tolist() if width else None
    lp_vals = reply.logprobs.numpy().reshape(-1, width).tolist() if width else None
    lp_ranks = reply.logprob_ranks.numpy().tolist() if width else None
    # A pooling worker's vectors, by row (a row whose prompt ended this step).
    pooled = {}
    if reply.pooled_width:
        vectors = reply.pooled.numpy().reshape(-1, reply.pooled_width)
        pooled = {row: vectors[i] for i, row in enumerate(reply.pooled_rows.numpy().tolist())}

    step.settle()
    offset = 0
    for row, seq in enumerate(step.rows):
        m = int(num_sampled[row]) if row < len(num_sampled) else 0
        start, offset = offset, offset + m
        request: Request = seq.request
        if seq.finished:  # aborted while the step ran
            continue
        if row in failed:
            request.finish("error", failed[row])
            changed[id(request)] = request
            continue
        before = seq.num_tokens
        # Preempted while the step ran (async scheduling): its tokens count, its KV went.
        placed = seq.row is not None
        if placed:
            seq.num_computed_tokens += step.num_tokens[row]
        if row in pooled:
            request.set_pooled(pooled[row], now)
            changed[id(request)] = request
            continue
        if m == 0:
            continue
        # A sampling row draws one uniform, and two per draft it verified.
        seq.generator_draws += 1 + 2 * (int(num_drafts[row]) if row < len(num_drafts) else 0)
        sl = slice(start, start + m)
        seq.append(
            tokens[sl],
            lp_ids[sl] if lp_ids is not None else None,
            lp_vals[sl] if lp_vals is not None else None,
            lp_ranks[sl] if lp_ranks is not None else None,
        )
        # Drafts the worker accepted were computed; the last token is not yet.
        if placed:
            seq.num_computed_tokens = before + m - 1
        request.note_tokens(now)
        changed[id(request)] = request

    if reply.prompt_logprobs_width:
        _merge_prompt_logprobs(step, reply)
        for row in reply.prompt_logprob_rows.numpy().tolist():
            request = step.rows[row].request
            changed[id(request)] = request
    return list(changed.values())


def _merge_prompt_logprobs(step: ScheduledStep, reply: StepReply) -> None:
    width = reply.prompt_logprobs_width
    ids = reply.prompt_logprob_token_ids.numpy().reshape(-1, width)
    vals = reply.prompt_logprobs.numpy().reshape(-1, width)
    ranks = reply.prompt_logprob_ranks.numpy()
    start = 0
    for row, count in zip(reply.prompt_logprob_rows.numpy().tolist(), reply.prompt_logprob_counts.numpy().tolist()):
        seq = step.rows[row]
        chunk = slice(start, start + count)
        start += count
        target = seq.request.prompt_logprobs
        if target is None:
            continue
        # A resumed sequence recomputes its prompt: skip positions already recorded.
        recorded = len(target) - 1  # the first prompt token has no entry
        skip = max(0, recorded - seq.prompt_logprobs_seen)
        seq.prompt_logprobs_seen += count
        if skip >= count:
            continue
        k = seq.params.prompt_logprobs
        w = width if k == -1 else min(k + 1, width)
        c_ids = ids[chunk][skip:, :w]
        texts = seq.detokenizer.decode_tokens(c_ids.reshape(-1).tolist())
        target.extend_arrays(c_ids, np.asarray(vals[chunk][skip:, :w]), ranks[chunk][skip:], texts)
