"""RejectionSampler against hand-derived expectations and the per-row reference.

Greedy rows: accept drafts while they equal the target argmax (after constraints, each
position seeing the drafts before it); the first mismatch emits the argmax and stops;
all accepted appends the bonus token; -1 pads. Random rows: the emitted tokens follow the
target distribution (statistical checks over >= 100k rows).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from reference_sampler import reference_greedy_rejection, reference_row, tv_distance
from sampler.metadata import SamplingMetadata
from sampler.params import SamplingParams
from sampler.rejection_sampler import RejectionSampler


def run_rejection(draft_token_ids, draft_probs, target_logits, bonus, params,
                  prompts=None, outputs=None, generators=None):
    n = len(params)
    vocab = target_logits.shape[1]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    md = SamplingMetadata.from_requests(
        params, prompts, [list(o) for o in outputs], vocab, "cpu", generators=generators)
    out = RejectionSampler(None)(
        draft_token_ids, draft_probs, target_logits,
        torch.as_tensor(bonus, dtype=torch.long), md)
    return out, md


def empirical(tokens, vocab):
    counts = [0] * vocab
    for t in tokens:
        counts[t] += 1
    total = max(len(tokens), 1)
    return [c / total for c in counts]


# -- greedy rows ------------------------------------------------------------------------


def test_greedy_accept_reject_bonus_and_padding_by_hand():
    vocab = 8

    def onehot_rows(argmaxes):
        rows = torch.zeros(len(argmaxes), vocab)
        for i, a in enumerate(argmaxes):
            rows[i, a] = 5.0
        return rows

    greedy = SamplingParams(temperature=0.0)
    cases = [
        # (drafts, target argmax per position, bonus, expected)
        ([1, 2, 3], [1, 2, 3], 7, [1, 2, 3, 7]),  # all accepted: bonus appended
        ([1, 2, 3], [1, 5, 3], 7, [1, 5, -1, -1]),  # mismatch at 1: emit argmax, stop
        ([4, 2, 3], [1, 2, 3], 7, [1, -1, -1, -1]),  # mismatch at 0
        ([], [], 6, [6, -1, -1, -1]),  # no drafts: just the bonus
        ([2], [2], 0, [2, 0, -1, -1]),  # shorter row: padded
        ([3, 3], [3, 4], 1, [3, 4, -1, -1]),
    ]
    drafts = [c[0] for c in cases]
    target = torch.cat([onehot_rows(c[1]) for c in cases if c[1]])
    bonus = [c[2] for c in cases]
    out, _ = run_rejection(drafts, None, target, bonus, [greedy] * len(cases))
    assert out.dtype in (torch.int64, torch.int32)
    assert out.tolist() == [c[3] for c in cases]


def test_all_rows_without_drafts_emit_only_the_bonus():
    out, _ = run_rejection([[], [], []], None, torch.zeros(0, 10), [4, 5, 6],
                           [SamplingParams(temperature=0.0), SamplingParams(),
                            SamplingParams(seed=3)])
    assert out.tolist() == [[4], [5], [6]]


GREEDY_RULES = [
    {},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8},
    {"repetition_penalty": 1.7},
    {"repetition_penalty": 0.5},
    {"logit_bias": {3: 2.0, 5: -1.0}},
    {"min_tokens": 4, "eos_token_ids": [0], "stop_token_ids": [1]},
    {"allowed_token_ids": list(range(0, 32, 2))},
    {"bad_words_token_ids": [[7], [2, 9]]},
    {"presence_penalty": 0.6, "repetition_penalty": 1.2, "bad_words_token_ids": [[4, 4]],
     "logit_bias": {0: 3.0}, "min_tokens": 3, "eos_token_ids": [0]},
]


@pytest.mark.parametrize("rule", range(len(GREEDY_RULES)))
def test_greedy_rows_against_reference(rule):
    """Random target logits; drafts that follow the reference argmax for a while then
    deviate (or not); the emitted tokens must equal the reference's."""
    vocab = 32
    kw = GREEDY_RULES[rule]
    rng = random.Random(rule)
    g = torch.Generator().manual_seed(100 + rule)
    params, prompts, outputs, drafts, target_rows, bonus = [], [], [], [], [], []
    for r in range(12):
        p = SamplingParams(temperature=0.0, **kw)
        prompt = [rng.randrange(vocab) for _ in range(4)]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(4))]
        k = r % 5  # 0..4 drafts
        accept = rng.randrange(k + 1)
        logits = torch.randn(k, vocab, generator=g) * 1.5
        row_drafts: list[int] = []
        for j in range(k):
            ref = reference_row(logits[j], p, prompt, output + row_drafts)
            if j < accept:
                row_drafts.append(ref.greedy_token)
            else:
                row_drafts.append(rng.choice([t for t in range(vocab) if t != ref.greedy_token]))
        params.append(p)
        prompts.append(prompt)
        outputs.append(output)
        drafts.append(row_drafts)
        target_rows.append(logits)
        bonus.append(rng.randrange(vocab))
    target = torch.cat(target_rows)
    out, _ = run_rejection(drafts, None, target, bonus, params, prompts, outputs)
    width = max(len(d) for d in drafts) + 1
    offset = 0
    for r in range(len(params)):
        k = len(drafts[r])
        expected = reference_greedy_rejection(target[offset: offset + k], drafts[r], bonus[r],
                                              params[r], prompts[r], outputs[r], width)
        offset += k
        assert out[r].tolist() == expected, f"row {r}"


def test_greedy_constraints_apply_before_the_argmax():
    """allowed_token_ids / logit_bias change the argmax the drafts are checked against."""
    row = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    cases = [
        (SamplingParams(temperature=0.0), [0], [0, 9]),
        (SamplingParams(temperature=0.0, allowed_token_ids=[2, 3]), [0], [2, -1]),
        (SamplingParams(temperature=0.0, allowed_token_ids=[2, 3]), [2], [2, 9]),
        (SamplingParams(temperature=0.0, logit_bias={4: 10.0}), [0], [4, -1]),
        (SamplingParams(temperature=0.0, bad_words_token_ids=[[0]]), [1], [1, 9]),
    ]
    out, _ = run_rejection([c[1] for c in cases], None, row.repeat(len(cases), 1),
                           [9] * len(cases), [c[0] for c in cases])
    assert out.tolist() == [c[2] for c in cases]


# -- penalties and masks see the draft prefix -------------------------------------------


def _two_positions(first_argmax: int, second: dict[int, float], vocab=8):
    logits = torch.zeros(2, vocab)
    logits[0, first_argmax] = 5.0
    for t, v in second.items():
        logits[1, t] = v
    return logits


@pytest.mark.parametrize("kw", [
    {"presence_penalty": 1.0},
    {"frequency_penalty": 1.0},
    {"repetition_penalty": 2.0},
])
def test_penalties_at_the_second_draft_see_the_first_draft(kw):
    """Draft [3, 3]: position 1's raw argmax is 3 (5.0 vs 4.5), but the first draft 3 is
    in the past there, so the penalty (presence 1 / frequency 1 / repetition 2) drops 3
    below 4: the second draft is rejected and 4 is emitted."""
    logits = _two_positions(3, {3: 5.0, 4: 4.5})
    params = [SamplingParams(temperature=0.0, **kw), SamplingParams(temperature=0.0)]
    out, _ = run_rejection([[3, 3], [3, 3]], None, torch.cat([logits, logits]), [7, 7], params)
    assert out.tolist() == [[3, 4, -1], [3, 3, 7]]
    for r in range(2):
        assert out[r].tolist() == reference_greedy_rejection(logits, [3, 3], 7, params[r])


def test_bad_words_at_the_second_draft_see_the_first_draft():
    """Banned sequence [3, 5]: at position 1 (past = [3]) token 5 is banned, so the draft 5
    is rejected and the runner-up 6 emitted; at position 0 (empty past) 5 is allowed."""
    vocab = 8
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 5]])
    logits = torch.zeros(2, vocab)
    logits[0, 3] = 5.0
    logits[1, 5], logits[1, 6] = 5.0, 4.0
    out, _ = run_rejection([[3, 5]], None, logits, [7], [params])
    assert out.tolist() == [[3, 6, -1]]
    logits2 = torch.zeros(2, vocab)
    logits2[0, 5], logits2[1, 2] = 5.0, 5.0
    out2, _ = run_rejection([[5, 2]], None, logits2, [7], [params])
    assert out2.tolist() == [[5, 2, 7]]
    # the output's tail counts as well: output [.., 3] bans 5 at position 0
    out3, _ = run_rejection([[5, 2]], None, logits2, [7], [params], outputs=[[1, 3]])
    assert out3[0, 0].item() != 5


def test_min_tokens_across_draft_positions_greedy():
    """output has 1 token, min_tokens=3, eos=7: the stop token is banned at positions 0
    and 1 (1 + j < 3) and allowed at position 2."""
    vocab = 8
    params = SamplingParams(temperature=0.0, min_tokens=3, eos_token_ids=[7])
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 9.0  # eos is the raw argmax everywhere
    logits[0, 2], logits[1, 4], logits[2, 6] = 3.0, 3.0, 3.0
    cases = [
        ([2, 4, 7], [2, 4, 7, 5]),  # runner-ups, then eos once allowed: all accepted
        ([7, 4, 7], [2, -1, -1, -1]),  # eos at position 0 rejected
        ([2, 7, 7], [2, 4, -1, -1]),  # eos at position 1 rejected
        ([2, 4, 6], [2, 4, 7, -1]),  # position 2's argmax is eos again
    ]
    out, _ = run_rejection([c[0] for c in cases], None, logits.repeat(len(cases), 1),
                           [5] * len(cases), [params] * len(cases),
                           outputs=[[1]] * len(cases))
    assert out.tolist() == [c[1] for c in cases]


@pytest.mark.statistical
def test_min_tokens_across_draft_positions_random():
    """Random rows: the stop token never appears where it is banned, and does once
    allowed."""
    vocab, n = 6, 20000
    params = SamplingParams(temperature=1.0, min_tokens=2, eos_token_ids=[0])
    logits = torch.zeros(3, vocab)
    logits[:, 0] = 3.0  # eos is likely when allowed
    logits[0, 1] = 3.0  # draft 1 at position 0 is accepted often (eos is banned there)
    logits[1, 2] = 3.0  # draft 2 at position 1 as well
    torch.manual_seed(0)
    out, _ = run_rejection([[1, 2, 0]] * n, None, logits.repeat(n, 1), [5] * n, [params] * n)
    assert (out[:, 0] != 0).all()
    assert (out[:, 1] != 0).all()  # 0 + 1 < 2: banned at position 1
    reached = out[:, 2] != -1
    assert reached.sum() > 100
    assert (out[reached, 2] == 0).any()
    # position 0's emitted token follows the reference (eos banned) distribution
    ref = reference_row(logits[0], params, (), ())
    assert ref.probs[0] == 0.0
    tv = tv_distance(empirical(out[:, 0].tolist(), vocab), ref.probs)
    assert tv < 0.02


# -- random rows: statistical checks ----------------------------------------------------

VOCAB = 6
TARGET_LOGITS = torch.tensor([
    [1.0, 2.0, 0.5, -1.0, 1.5, 0.0],
    [0.0, -0.5, 2.5, 1.0, 0.2, 1.2],
])
DRAFT_Q = torch.tensor([
    [0.40, 0.05, 0.25, 0.10, 0.05, 0.15],
    [0.05, 0.30, 0.05, 0.30, 0.20, 0.10],
])
N_STAT = 100_000


def _sample_drafts(n, k, gen):
    return [torch.multinomial(DRAFT_Q[j], n, replacement=True, generator=gen) for j in range(k)]


def _stat_run(params_kw, k, with_q, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cols = _sample_drafts(N_STAT, k, gen)
    drafts = torch.stack(cols, dim=1).tolist()
    target = TARGET_LOGITS[:k].repeat(N_STAT, 1)
    draft_probs = DRAFT_Q[:k].repeat(N_STAT, 1) if with_q else None
    params = SamplingParams(**params_kw)
    torch.manual_seed(seed + 1)
    out, _ = run_rejection(drafts, draft_probs, target, [5] * N_STAT, [params] * N_STAT)
    refs = [reference_row(TARGET_LOGITS[j], params) for j in range(k)]
    return out, refs, torch.tensor(drafts)


STAT_PARAMS = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 4},
    {"temperature": 0.9, "top_p": 0.8},
]


# (knobs index, drafts per row, with draft_probs); 100k rows per case, so only a selection
STAT_CASES = [
    (0, 1, True),
    (0, 1, False),
    (1, 2, True),
    (1, 2, False),
    (2, 2, True),
    (3, 2, False),
]


@pytest.mark.statistical
@pytest.mark.parametrize("pi,k,with_q", STAT_CASES, ids=[
    f"{STAT_PARAMS[pi]}-k{k}-{'draft_probs' if q else 'draft_free'}" for pi, k, q in STAT_CASES])
def test_first_emitted_token_follows_the_target(pi, k, with_q):
    out, refs, drafts = _stat_run(STAT_PARAMS[pi], k, with_q, seed=pi * 10 + k)
    p0 = refs[0].probs
    q0 = DRAFT_Q[0].tolist() if with_q else None
    assert tv_distance(p0, DRAFT_Q[0].tolist()) > 0.2  # the draft is far from the target
    first = out[:, 0].tolist()
    assert set(first) <= refs[0].support
    tv = tv_distance(empirical(first, VOCAB), p0)
    assert tv < 0.01, f"TV {tv:.4f}"
    # acceptance rate at position 0: sum_x min(p, q) with q the draft distribution, or
    # E_d[p(d)] for a draft-free proposer (q a point mass on the draft)
    accepted = out[:, 1] != -1
    if with_q:
        rate = sum(min(a, b) for a, b in zip(p0, q0))
    else:
        rate = sum(DRAFT_Q[0, x].item() * p0[x] for x in range(VOCAB))
    assert abs(accepted.float().mean().item() - rate) < 0.01
    # an accepted first draft is emitted as itself
    assert (out[accepted, 0] == drafts[accepted, 0]).all()
    if k == 1:
        assert (out[accepted, 1] == 5).all()  # the bonus
    else:
        # given the first draft was accepted, the second emitted token follows p1
        second = out[accepted, 1].tolist()
        assert set(second) <= refs[1].support
        tv1 = tv_distance(empirical(second, VOCAB), refs[1].probs)
        assert tv1 < 0.015, f"TV {tv1:.4f}"
        both = out[:, 2] != -1
        assert (out[both, 2] == 5).all()
        assert (out[both, 1] == drafts[both, 1]).all()


@pytest.mark.statistical
def test_mixed_greedy_and_random_rows():
    """Greedy rows interleaved with random rows in one call: greedy rows are exact, the
    random rows still follow the target."""
    n = 40_000
    gen = torch.Generator().manual_seed(3)
    d0 = torch.multinomial(DRAFT_Q[0], n, replacement=True, generator=gen).tolist()
    params, drafts, probs = [], [], []
    greedy = SamplingParams(temperature=0.0)
    rand = SamplingParams(temperature=0.8)
    for i in range(n):
        params.append(greedy if i % 4 == 0 else rand)
        drafts.append([d0[i]])
        probs.append(DRAFT_Q[0])
    torch.manual_seed(4)
    out, _ = run_rejection(drafts, torch.stack(probs), TARGET_LOGITS[:1].repeat(n, 1),
                           [5] * n, params)
    argmax = int(TARGET_LOGITS[0].argmax())
    for i in range(0, n, 4):
        expected = [argmax, 5] if d0[i] == argmax else [argmax, -1]
        assert out[i].tolist() == expected
    rand_rows = [i for i in range(n) if i % 4]
    ref = reference_row(TARGET_LOGITS[0], rand)
    tv = tv_distance(empirical(out[rand_rows, 0].tolist(), VOCAB), ref.probs)
    assert tv < 0.015


# -- seeded rows ------------------------------------------------------------------------


def _seeded_problem(n_seeds, k):
    gen = torch.Generator().manual_seed(8)
    drafts = torch.stack(_sample_drafts(n_seeds, k, gen), dim=1).tolist()
    return drafts


def test_seeded_rows_reproducible_in_the_same_batch():
    n = 300
    drafts = _seeded_problem(n, 2)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    target = TARGET_LOGITS.repeat(n, 1)
    q = DRAFT_Q.repeat(n, 1)
    torch.manual_seed(0)
    a, _ = run_rejection(drafts, q, target, [5] * n, params)
    torch.manual_seed(1)
    b, _ = run_rejection(drafts, q, target, [5] * n, params)
    assert torch.equal(a, b)
    # different seeds give different results on some rows
    params2 = [SamplingParams(temperature=1.0, seed=s + 10_000) for s in range(n)]
    c, _ = run_rejection(drafts, q, target, [5] * n, params2)
    assert not torch.equal(a, c)


# Regression: seeded rows used to draw 2 * (the batch's max draft count) uniforms and take
# the recovery uniforms at that offset, so their tokens depended on the other rows.
def test_seeded_rows_reproducible_regardless_of_neighbours():
    """A seeded row with one draft gives the same tokens alone and next to a row with
    three drafts (and at another row index)."""
    n = 40
    drafts = _seeded_problem(n, 1)
    q = DRAFT_Q[:1]
    target = TARGET_LOGITS[:1]
    alone, together = [], []
    for s in range(n):
        p = SamplingParams(temperature=1.0, seed=s)
        out, _ = run_rejection([drafts[s]], q, target, [5], [p])
        alone.append(out[0].tolist())
        neighbour = SamplingParams(temperature=1.0)
        out2, _ = run_rejection(
            [[1, 2, 3], drafts[s]], torch.cat([DRAFT_Q[[0, 1, 1]], q]),
            torch.cat([TARGET_LOGITS[[0, 1, 1]], target]), [4, 5], [neighbour, p])
        together.append(out2[1, :2].tolist())
    assert alone == together


def test_seeded_rows_reproducible_at_another_row_index_same_layout():
    """Same draft counts everywhere: the seeded row's tokens do not depend on its row
    index or on unseeded neighbours."""
    n = 40
    drafts = _seeded_problem(n, 2)
    alone, moved = [], []
    for s in range(n):
        p = SamplingParams(temperature=1.0, seed=s)
        out, _ = run_rejection([drafts[s]], DRAFT_Q, TARGET_LOGITS, [5], [p])
        alone.append(out[0].tolist())
        out2, _ = run_rejection(
            [[0, 1], [2, 3], drafts[s]], DRAFT_Q.repeat(3, 1), TARGET_LOGITS.repeat(3, 1),
            [4, 4, 5], [SamplingParams(), SamplingParams(temperature=0.0), p])
        moved.append(out2[2].tolist())
    assert alone == moved


def test_shape_errors():
    md = SamplingMetadata.from_requests([SamplingParams()], [[]], [[]], 6)
    with pytest.raises(ValueError):
        RejectionSampler(None)([[1, 2]], None, torch.zeros(3, 6), torch.tensor([0]), md)
    with pytest.raises(ValueError):
        RejectionSampler(None)([[1, 2]], torch.zeros(2, 5), torch.zeros(2, 6),
                               torch.tensor([0]), md)


def test_acceptance_probability_formula_single_row():
    """A hand-computed case: p = softmax(target), q given, draft d: the first token equals
    d with probability min(1, p(d)/q(d)) + (1 - min(1, p(d)/q(d))) * r(d) where r is the
    normalised residual max(p - q, 0) (r(d) = 0 here because q(d) > p(d))."""
    n = 50_000
    target = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    q = torch.tensor([[0.5, 0.3, 0.2]])
    params = SamplingParams(temperature=1.0)
    torch.manual_seed(5)
    out, _ = run_rejection([[0]] * n, q.repeat(n, 1), target.repeat(n, 1), [2] * n, [params] * n)
    # accept 0 with prob 0.1 / 0.5 = 0.2; otherwise residual (0, 0.3, 0.1) / 0.4
    freq0 = (out[:, 0] == 0).float().mean().item()
    freq1 = (out[:, 0] == 1).float().mean().item()
    assert abs(freq0 - 0.2) < 0.01
    assert abs(freq1 - 0.8 * 0.75) < 0.01
    assert math.isclose(((out[:, 1] == 2).float().mean().item()), freq0, abs_tol=1e-9)
