"""An independent, one-row-at-a-time reference of the sampler's processing.

Written from the rules (vLLM V1 semantics as the project states them), with plain Python
loops over float64 numbers, never by calling ``sampler``'s code. Used by
``test_sampler.py`` and ``test_rejection_sampler.py``.

Order of operations for one row:

1. the logits as float32 (then computed on in float64);
2. raw logprobs = log_softmax(raw logits);
3. allowed_token_ids: every other token -inf;
4. bad words: for each banned sequence, its last token is -inf when the past tokens end
   with the rest of it (a one-token sequence is always banned);
5. logit_bias added;
6. min_tokens: the stop tokens (stop_token_ids, plus eos_token_ids unless ignore_eos) are
   -inf while len(past tokens) < min_tokens;
7. repetition penalty on tokens in the prompt or the past tokens (logit > 0 divided by
   the penalty, else multiplied), then frequency (minus freq * count in the past tokens)
   and presence (minus pres when in the past tokens);
8. (optional) a forced token (thinking budget): only it survives, with logit 0;
9. greedy rows (temperature < 1e-5): argmax (first index on ties) of the above;
10. random rows: divide by temperature; min-p (mask prob < min_p * max prob); top-k (keep
    logits >= the k-th largest value, ties kept; 0 / -1 disabled); top-p over the
    top-k-renormalised probabilities (in descending order keep tokens while the mass
    before them is < p; the most likely is always kept); softmax.

"Past tokens" are the output tokens (plus, in speculative decoding, the draft tokens
before the position).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NEG_INF = float("-inf")
_GREEDY_EPS = 1e-5


@dataclass
class RefRow:
    raw_logits: list[float]
    raw_logprobs: list[float]
    constrained: list[float]  # steps 3-8: what greedy rows take the argmax of
    greedy_token: int  # argmax of ``constrained``
    is_greedy: bool
    final_logits: list[float]  # random rows: after temperature/min-p/top-k/top-p
    probs: list[float]  # the sampling distribution (one-hot for greedy rows)

    @property
    def processed_logprobs(self) -> list[float]:
        return log_softmax(self.final_logits)

    @property
    def support(self) -> set[int]:
        return {i for i, p in enumerate(self.probs) if p > 0}


def _to_float32_list(logits) -> list[float]:
    """Rounds to float32 exactly (the sampler's first step) and returns Python floats."""
    if hasattr(logits, "detach"):
        import torch

        return logits.detach().to("cpu", torch.float32).tolist()
    import struct

    return [struct.unpack("f", struct.pack("f", float(x)))[0] for x in logits]


def logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    if m == NEG_INF:
        return NEG_INF
    return m + math.log(sum(math.exp(x - m) for x in xs if x != NEG_INF))


def softmax(xs: Sequence[float]) -> list[float]:
    lse = logsumexp(xs)
    return [0.0 if x == NEG_INF else math.exp(x - lse) for x in xs]


def log_softmax(xs: Sequence[float]) -> list[float]:
    lse = logsumexp(xs)
    return [NEG_INF if x == NEG_INF else x - lse for x in xs]


def argmax(xs: Sequence[float]) -> int:
    best = 0
    for i, x in enumerate(xs):
        if x > xs[best]:
            best = i
    return best


def stop_token_ids(params) -> set[int]:
    ids = set(params.stop_token_ids or [])
    if not params.ignore_eos:
        ids |= set(params.eos_token_ids or [])
    return ids


def constrain(
    logits: list[float],
    params,
    prompt: Sequence[int],
    past: Sequence[int],
    forced_token: int | None = None,
) -> list[float]:
    """Steps 3-8 on a copy of ``logits``."""
    x = list(logits)
    vocab = len(x)
    # 3. allowed_token_ids
    if params.allowed_token_ids:
        allowed = set(params.allowed_token_ids)
        for t in range(vocab):
            if t not in allowed:
                x[t] = NEG_INF
    # 4. bad words
    for seq in params.bad_words_token_ids or []:
        prefix = list(seq[:-1])
        if not prefix or (len(past) >= len(prefix) and list(past[len(past) - len(prefix):]) == prefix):
            x[seq[-1]] = NEG_INF
    # 5. logit bias
    for t, b in (params.logit_bias or {}).items():
        x[int(t)] += b
    # 6. min tokens
    if len(past) < params.min_tokens:
        for t in stop_token_ids(params):
            x[t] = NEG_INF
    # 7. penalties
    rep = params.repetition_penalty
    if rep != 1.0:
        seen = set(prompt) | set(past)
        for t in seen:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    counts: dict[int, int] = {}
    for t in past:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c
        x[t] -= params.presence_penalty
    # 8. forced token
    if forced_token is not None:
        x = [NEG_INF] * vocab
        x[forced_token] = 0.0
    return x


def truncate(x: list[float], params) -> list[float]:
    """Step 10 without the softmax: temperature, min-p, top-k, top-p."""
    vocab = len(x)
    x = [v / params.temperature for v in x]
    # min-p
    if params.min_p > 0:
        probs = softmax(x)
        threshold = params.min_p * max(probs)
        x = [NEG_INF if probs[i] < threshold else x[i] for i in range(vocab)]
    # top-k
    k = params.top_k
    if k not in (0, -1) and k < vocab:
        kth = sorted(x, reverse=True)[k - 1]
        x = [v if v >= kth else NEG_INF for v in x]
    # top-p
    if params.top_p < 1.0:
        probs = softmax(x)
        order = sorted(range(vocab), key=lambda i: (-x[i], i))
        keep = set()
        before = 0.0
        for rank, i in enumerate(order):
            if rank == 0 or before < params.top_p:
                keep.add(i)
            else:
                break
            before += probs[i]
        x = [x[i] if i in keep else NEG_INF for i in range(vocab)]
    return x


def reference_row(
    logits,
    params,
    prompt: Sequence[int] = (),
    past: Sequence[int] = (),
    forced_token: int | None = None,
) -> RefRow:
    """Processes one row of ``logits`` (a 1-D tensor or a list) for ``params``."""
    raw = _to_float32_list(logits)
    raw_lp = log_softmax(raw)
    constrained = constrain(raw, params, prompt, past, forced_token)
    greedy_token = argmax(constrained)
    is_greedy = params.temperature < _GREEDY_EPS
    if is_greedy:
        final = list(constrained)
        probs = [0.0] * len(raw)
        probs[greedy_token] = 1.0
    else:
        final = truncate(constrained, params)
        probs = softmax(final)
    return RefRow(
        raw_logits=raw,
        raw_logprobs=raw_lp,
        constrained=constrained,
        greedy_token=greedy_token,
        is_greedy=is_greedy,
        final_logits=final,
        probs=probs,
    )


def reference_batch(logits, params, prompts, outputs) -> list[RefRow]:
    return [
        reference_row(logits[i], params[i], prompts[i], outputs[i]) for i in range(len(params))
    ]


def tv_distance(p: Sequence[float], q: Sequence[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def reference_rejection_row(
    target_logits_rows,
    drafts: Sequence[int],
    params,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
) -> list[RefRow]:
    """The target at each draft position j: the row's output plus ``drafts[:j]`` as past."""
    return [
        reference_row(target_logits_rows[j], params, prompt, list(output) + list(drafts[:j]))
        for j in range(len(drafts))
    ]


def reference_greedy_rejection(
    target_logits_rows,
    drafts: Sequence[int],
    bonus: int,
    params,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    width: int | None = None,
) -> list[int]:
    """Greedy verification: accept drafts while they equal the target argmax; the first
    mismatch emits the argmax and stops; all accepted appends the bonus. Padded with -1
    to ``width`` (default len(drafts) + 1)."""
    width = len(drafts) + 1 if width is None else width
    emitted: list[int] = []
    refs = reference_rejection_row(target_logits_rows, drafts, params, prompt, output)
    for j, d in enumerate(drafts):
        target = refs[j].greedy_token
        if d == target:
            emitted.append(d)
        else:
            emitted.append(target)
            break
    else:
        emitted.append(bonus)
    return emitted + [-1] * (width - len(emitted))
