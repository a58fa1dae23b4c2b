"""The Sampler against the independent per-row reference in ``reference_sampler.py``.

Greedy rows must equal the reference argmax exactly; random rows must have the
reference's support and probabilities (read back through ``processed_logprobs`` with the
full vocabulary), and their empirical frequencies must be within a TV bound of the
reference distribution. Logprobs are checked in all four modes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from reference_sampler import NEG_INF, reference_row, softmax, tv_distance
from sampler.config import SamplerConfig
from sampler.metadata import SamplingMetadata
from sampler.params import SamplingParams
from sampler.sampler import Sampler
from sampler.thinking_budget import ReasoningConfig, ThinkingBudgetStateHolder

# -- helpers ----------------------------------------------------------------------------


def full_config(vocab: int, rows: int) -> SamplerConfig:
    """A config that allows logprobs=-1 (the whole vocabulary) for any vocabulary."""
    return SamplerConfig(vocab_size=vocab, max_num_seqs=max(rows, 1), max_logprobs=-1)


def run_sampler(logits, params, prompts=None, outputs=None, mode=None, config=None,
                generators=None, thinking_budget=None):
    n, vocab = logits.shape
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    md = SamplingMetadata.from_requests(
        params, prompts, [list(o) for o in outputs], vocab, "cpu",
        config=config, generators=generators, thinking_budget=thinking_budget,
    )
    out = Sampler(None, logprobs_mode=mode)(logits, md)
    return out, md


def full_vector(out, row: int, vocab: int) -> list[float]:
    """The row's values over the whole vocabulary, from a logprobs=-1 result."""
    lt = out.logprobs_tensors
    ids = lt.token_ids[row, 1:].tolist()
    vals = lt.logprobs[row, 1:].tolist()
    assert sorted(ids) == list(range(vocab)), "logprobs=-1 must cover the whole vocabulary"
    vec = [0.0] * vocab
    for t, v in zip(ids, vals):
        vec[t] = v
    return vec


def assert_vectors_close(actual, expected, atol=1e-4, rtol=1e-4, what=""):
    assert len(actual) == len(expected)
    for t, (a, e) in enumerate(zip(actual, expected)):
        if e == NEG_INF or a == NEG_INF:
            assert a == e, f"{what} token {t}: got {a}, expected {e}"
        else:
            assert math.isfinite(a), f"{what} token {t}: got {a}, expected {e}"
            assert abs(a - e) <= atol + rtol * abs(e), f"{what} token {t}: got {a}, expected {e}"


def expected_tv(probs, n: int) -> float:
    """Mean TV distance of an n-sample empirical distribution from ``probs`` (normal
    approximation)."""
    return 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in probs if p > 0)


def empirical(tokens: list[int], vocab: int) -> list[float]:
    counts = [0] * vocab
    for t in tokens:
        counts[t] += 1
    return [c / len(tokens) for c in counts]


def make_logits(n, vocab, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def top_tokens(row, k):
    return torch.topk(row, k).indices.tolist()


# -- rule cases: (params kwargs, prompt, output) built from a row's logits ---------------


def case_plain(row, rng):
    return {}, [rng.randrange(len(row)) for _ in range(3)], [rng.randrange(len(row)) for _ in range(2)]


def case_allowed(row, rng):
    vocab = len(row)
    top = top_tokens(row, 3)
    allowed = sorted(set(rng.sample(range(vocab), vocab // 3)) - set(top[:1]))
    return {"allowed_token_ids": allowed}, [], []


def case_bad_words(row, rng):
    top = top_tokens(row, 4)
    # single-token: always banned; multi-token with matching prefix: banned;
    # multi-token with a non-matching prefix: not banned.
    seqs = [[top[0]], [9, 4, top[1]], [5, top[2]], [7, 7, 7, top[3]]]
    output = [3, 9, 4]  # ends with [9, 4]; does not end with [5] nor [7, 7, 7]
    return {"bad_words_token_ids": seqs}, [], output


def case_logit_bias(row, rng):
    top = top_tokens(row, 2)
    low = top_tokens(-row, 2)
    return {"logit_bias": {top[0]: -3.5, low[0]: 6.0, low[1]: 2.5, top[1]: 0.5}}, [], []


def case_min_tokens(row, rng):
    top = top_tokens(row, 3)
    return ({"min_tokens": 4, "eos_token_ids": [top[0]], "stop_token_ids": [top[1]]},
            [], [11, 12])


def case_min_tokens_ignore_eos(row, rng):
    top = top_tokens(row, 3)
    return ({"min_tokens": 4, "eos_token_ids": [top[0]], "stop_token_ids": [top[1]],
             "ignore_eos": True}, [], [11, 12])


def case_min_tokens_reached(row, rng):
    top = top_tokens(row, 3)
    return ({"min_tokens": 2, "eos_token_ids": [top[0]], "stop_token_ids": [top[1]]},
            [], [11, 12])


def _seen_tokens(row, rng):
    top = top_tokens(row, 6)
    low = top_tokens(-row, 2)
    prompt = [top[0], low[0], 13, top[3]]
    output = [top[1], top[1], top[2], low[1], top[0], top[1]]
    return prompt, output


def case_repetition_up(row, rng):
    prompt, output = _seen_tokens(row, rng)
    return {"repetition_penalty": 1.8}, prompt, output


def case_repetition_down(row, rng):
    prompt, output = _seen_tokens(row, rng)
    return {"repetition_penalty": 0.6}, prompt, output


def case_frequency(row, rng):
    prompt, output = _seen_tokens(row, rng)
    return {"frequency_penalty": 0.9}, prompt, output


def case_presence(row, rng):
    prompt, output = _seen_tokens(row, rng)
    return {"presence_penalty": 1.7}, prompt, output


def case_negative_penalties(row, rng):
    prompt, output = _seen_tokens(row, rng)
    return {"presence_penalty": -1.2, "frequency_penalty": -0.4}, prompt, output


def case_combo(row, rng):
    vocab = len(row)
    prompt, output = _seen_tokens(row, rng)
    top = top_tokens(row, 8)
    return ({
        "repetition_penalty": 1.3, "frequency_penalty": 0.3, "presence_penalty": 0.5,
        "logit_bias": {top[5]: 1.5, top[0]: -0.7},
        "bad_words_token_ids": [[top[4]], [output[-1], top[6]]],
        "min_tokens": 10, "eos_token_ids": [top[2]],
        "allowed_token_ids": sorted(set(rng.sample(range(vocab), vocab // 2)) | set(top[:7])),
    }, prompt, output)


CASES = {
    "plain": case_plain,
    "allowed": case_allowed,
    "bad_words": case_bad_words,
    "logit_bias": case_logit_bias,
    "min_tokens": case_min_tokens,
    "min_tokens_ignore_eos": case_min_tokens_ignore_eos,
    "min_tokens_reached": case_min_tokens_reached,
    "repetition_up": case_repetition_up,
    "repetition_down": case_repetition_down,
    "frequency": case_frequency,
    "presence": case_presence,
    "negative_penalties": case_negative_penalties,
    "combo": case_combo,
}

# Sampling knobs for random rows.
RANDOM_KNOBS = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.7, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.7},
    {"temperature": 1.2, "min_p": 0.08},
    {"temperature": 0.8, "top_k": 12, "top_p": 0.85, "min_p": 0.02},
    {"temperature": 1.0, "top_k": 0},
    {"temperature": 1.0, "top_k": -1, "top_p": 0.95},
]


def build_case_batch(case_fn, vocab, seed, knobs_list):
    """One row per knob set, each with its own random logits and the case's rules."""
    rng = random.Random(seed)
    logits = make_logits(len(knobs_list), vocab, seed)
    params, prompts, outputs = [], [], []
    for i, knobs in enumerate(knobs_list):
        kw, prompt, output = case_fn(logits[i], rng)
        params.append(SamplingParams(**kw, **knobs))
        prompts.append(prompt)
        outputs.append(output)
    return logits, params, prompts, outputs


# -- greedy rows: exact argmax ----------------------------------------------------------


@pytest.mark.parametrize("vocab", [48, 1000])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_rows_equal_reference_argmax(case, vocab):
    knobs = [{"temperature": 0.0}] * 6
    logits, params, prompts, outputs = build_case_batch(CASES[case], vocab, 17 + vocab, knobs)
    out, _ = run_sampler(logits, params, prompts, outputs)
    for i in range(len(params)):
        ref = reference_row(logits[i], params[i], prompts[i], outputs[i])
        assert out.sampled_token_ids[i].item() == ref.greedy_token, f"row {i}"


def test_greedy_rule_cases_actually_change_the_argmax():
    """Sanity check of the cases: most rule cases move the argmax away from the raw one
    (so the greedy comparison above can fail)."""
    changed = 0
    for case in CASES:
        logits, params, prompts, outputs = build_case_batch(
            CASES[case], 48, 65, [{"temperature": 0.0}] * 6)
        for i in range(len(params)):
            ref = reference_row(logits[i], params[i], prompts[i], outputs[i])
            changed += ref.greedy_token != int(logits[i].argmax())
    assert changed >= 30


# -- random rows: support and probabilities via processed logprobs ----------------------


@pytest.mark.parametrize("vocab", [40, 1000])
@pytest.mark.parametrize("case", list(CASES))
def test_random_rows_distribution_equals_reference(case, vocab):
    logits, params, prompts, outputs = build_case_batch(CASES[case], vocab, 101 + vocab,
                                                        RANDOM_KNOBS)
    for p in params:
        p.logprobs = -1
    out, _ = run_sampler(logits, params, prompts, outputs, mode="processed_logprobs",
                         config=full_config(vocab, len(params)))
    for i in range(len(params)):
        ref = reference_row(logits[i], params[i], prompts[i], outputs[i])
        got = full_vector(out, i, vocab)
        assert_vectors_close(got, ref.processed_logprobs, what=f"row {i} {RANDOM_KNOBS[i]}")
        assert out.sampled_token_ids[i].item() in ref.support


def test_mixed_greedy_and_random_rows_in_one_batch():
    vocab = 64
    rng = random.Random(5)
    names = list(CASES)
    n = 26
    logits = make_logits(n, vocab, 99)
    params, prompts, outputs = [], [], []
    for i in range(n):
        kw, prompt, output = CASES[names[i % len(names)]](logits[i], rng)
        knobs = {"temperature": 0.0} if i % 2 == 0 else RANDOM_KNOBS[i % len(RANDOM_KNOBS)]
        params.append(SamplingParams(**kw, **knobs, logprobs=-1))
        prompts.append(prompt)
        outputs.append(output)
    out, _ = run_sampler(logits, params, prompts, outputs, mode="processed_logprobs",
                         config=full_config(vocab, n))
    for i in range(n):
        ref = reference_row(logits[i], params[i], prompts[i], outputs[i])
        tok = out.sampled_token_ids[i].item()
        if ref.is_greedy:
            assert tok == ref.greedy_token, f"greedy row {i}"
            assert_vectors_close(full_vector(out, i, vocab), ref.processed_logprobs,
                                 what=f"greedy row {i}")
        else:
            assert tok in ref.support, f"random row {i}"
            assert_vectors_close(full_vector(out, i, vocab), ref.processed_logprobs,
                                 what=f"random row {i}")


def test_top20_processed_logprobs_vocab_1000():
    """Without raising max_logprobs: the top-20 processed logprobs equal the reference's."""
    vocab = 1000
    logits, params, prompts, outputs = build_case_batch(case_combo, vocab, 7, RANDOM_KNOBS)
    for p in params:
        p.logprobs = 20
    out, _ = run_sampler(logits, params, prompts, outputs, mode="processed_logprobs")
    lt = out.logprobs_tensors
    assert lt.token_ids.shape == (len(params), 21)
    for i in range(len(params)):
        ref = reference_row(logits[i], params[i], prompts[i], outputs[i])
        lp = ref.processed_logprobs
        order = sorted(range(vocab), key=lambda t: -lp[t])[:20]
        finite = [t for t in order if lp[t] != NEG_INF]
        got_ids = lt.token_ids[i, 1:].tolist()
        got_vals = lt.logprobs[i, 1:].tolist()
        assert got_ids[: len(finite)] == finite, f"row {i}"
        assert_vectors_close(got_vals, [lp[t] for t in order], what=f"row {i}")


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_and_minus_one_disable_top_k(top_k):
    vocab = 50
    logits = make_logits(3, vocab, 3)
    params = [SamplingParams(temperature=t, top_k=top_k, logprobs=-1) for t in (1.0, 0.5, 2.0)]
    out, _ = run_sampler(logits, params, mode="processed_logprobs",
                         config=full_config(vocab, 3))
    for i in range(3):
        ref = reference_row(logits[i], params[i])
        assert len(ref.support) == vocab
        assert_vectors_close(full_vector(out, i, vocab), ref.processed_logprobs)


def test_top_k_larger_than_vocab_is_a_no_op():
    vocab = 30
    logits = make_logits(1, vocab, 4)
    params = [SamplingParams(top_k=500, logprobs=-1)]
    out, _ = run_sampler(logits, params, mode="processed_logprobs", config=full_config(vocab, 1))
    assert_vectors_close(full_vector(out, 0, vocab), reference_row(logits[0], params[0]).processed_logprobs)


def test_top_k_keeps_ties_at_the_kth_value_small_vocab():
    vocab = 12
    row = torch.tensor([0.0, 3.0, 1.0, 3.0, 2.0, 2.0, 2.0, -1.0, 0.5, 2.0, 0.0, 1.5])
    params = [SamplingParams(top_k=4, logprobs=-1)]
    out, _ = run_sampler(row.unsqueeze(0), params, mode="processed_logprobs")
    ref = reference_row(row, params[0])
    assert ref.support == {1, 3, 4, 5, 6, 9}
    assert_vectors_close(full_vector(out, 0, vocab), ref.processed_logprobs)


# Regression: top-k rows used to keep only their first W sorted candidates (W = 64 or
# 1024, at least the largest k), dropping ties at the k-th value beyond W.
@pytest.mark.parametrize("vocab,ties", [(200, 100), (3000, 1500)])
def test_top_k_keeps_ties_beyond_the_candidate_width(vocab, ties):
    row = torch.full((vocab,), -5.0)
    row[:ties] = 1.0  # ``ties`` tokens tie for the largest value
    params = [SamplingParams(top_k=3, logprobs=-1)]
    out, _ = run_sampler(row.unsqueeze(0), params, mode="processed_logprobs",
                         config=full_config(vocab, 1))
    ref = reference_row(row, params[0])
    assert len(ref.support) == ties
    got = full_vector(out, 0, vocab)
    assert {t for t, v in enumerate(got) if v != NEG_INF} == ref.support


def _min_top_p_margin(logits_row, params) -> float:
    """min |mass before - top_p| over the tokens in descending order of the reference's
    pre-top-p distribution (how much float precision the top-p cut needs)."""
    pre = reference_row(logits_row, params.clone(top_p=1.0)).final_logits
    probs = softmax(pre)
    order = sorted(range(len(pre)), key=lambda i: -pre[i])
    before, margin = 0.0, 1.0
    for i in order:
        if probs[i] == 0:
            break
        margin = min(margin, abs(before - params.top_p))
        before += probs[i]
    return margin


def test_mixed_batch_with_top_p_over_the_whole_vocabulary():
    """A near-flat row with top_p=0.99 needs far more than the candidate width; the other
    rows are peaked. Every row must match the reference."""
    vocab = 5000
    params = [
        SamplingParams(top_p=0.99, logprobs=-1),
        SamplingParams(top_k=5, logprobs=-1),
        SamplingParams(temperature=0.0, logprobs=-1),
        SamplingParams(top_k=2500, top_p=0.9, logprobs=-1),
        SamplingParams(top_p=0.5, temperature=0.7, logprobs=-1),
        SamplingParams(temperature=1.3, logprobs=-1),
    ]
    # The first seed whose top-p cuts are well clear of float rounding (a fixed choice).
    for seed in range(11, 100):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(6, vocab, generator=g) * 3.0
        logits[0] = torch.randn(vocab, generator=g) * 0.05  # near-flat
        logits[3] = torch.randn(vocab, generator=g) * 0.05  # near-flat, also with top-k
        if all(_min_top_p_margin(logits[i], params[i]) > 2e-5 for i in (0, 3, 4)):
            break
    else:
        raise AssertionError("no well-posed seed")
    out, _ = run_sampler(logits, params, mode="processed_logprobs",
                         config=full_config(vocab, len(params)))
    for i, p in enumerate(params):
        ref = reference_row(logits[i], p)
        if i == 0:
            assert 4000 < len(ref.support) < vocab
        got = full_vector(out, i, vocab)
        if not ref.is_greedy:
            assert {t for t, v in enumerate(got) if v != NEG_INF} == ref.support, f"row {i}"
        assert_vectors_close(got, ref.processed_logprobs, atol=2e-4, what=f"row {i}")
        tok = out.sampled_token_ids[i].item()
        if ref.is_greedy:
            assert tok == ref.greedy_token
        else:
            assert tok in ref.support


# -- hand-derived rule checks -----------------------------------------------------------


def test_bad_words_multi_token_prefix_by_hand():
    row = torch.tensor([0.0, 1.0, 0.5, 0.2, 0.1, 0.3, 0.4, 5.0, 4.0, 0.6])
    seqs = [[2, 3, 7], [5]]
    params = SamplingParams(temperature=0.0, bad_words_token_ids=seqs)
    outputs = [[1, 2, 3], [3, 3], [3], [], [2, 3, 7, 2, 3]]
    # 7 is banned only when the output ends with [2, 3]; 5 is always banned.
    expected = [8, 7, 7, 7, 8]
    logits = row.repeat(len(outputs), 1)
    logits[:, 5] = 9.0  # 5 would win if it were not banned
    out, _ = run_sampler(logits, [params] * len(outputs), outputs=outputs)
    assert out.sampled_token_ids.tolist() == expected


def test_allowed_token_ids_by_hand():
    vocab = 16
    logits = make_logits(2, vocab, 8)
    allowed = [3, 9, 14]
    best = max(allowed, key=lambda t: logits[0, t].item())
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, allowed_token_ids=allowed, logprobs=-1)]
    out, _ = run_sampler(logits, params, mode="processed_logprobs")
    assert out.sampled_token_ids[0].item() == best
    got = full_vector(out, 1, vocab)
    assert {t for t, v in enumerate(got) if v != NEG_INF} == set(allowed)
    expected = softmax([logits[1, t].item() for t in allowed])
    for t, e in zip(allowed, expected):
        assert math.isclose(math.exp(got[t]), e, rel_tol=1e-5)


def test_penalties_processed_logits_by_hand():
    """processed_logits at temperature 1: the penalised logits, computed by hand."""
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    prompt = [0, 1]
    output = [3, 3, 4, 2]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25, logprobs=-1)
    out, _ = run_sampler(row.unsqueeze(0), [params], [prompt], [output], mode="processed_logits")
    expected = [
        2.0 / 2,  # prompt, positive: divided
        -1.0 * 2,  # prompt, negative: multiplied
        0.5 / 2 - 0.5 * 1 - 0.25,  # output once
        3.0 / 2 - 0.5 * 2 - 0.25,  # output twice
        -2.0 * 2 - 0.5 * 1 - 0.25,  # output once, negative
        1.0,  # unseen
    ]
    assert_vectors_close(full_vector(out, 0, 6), expected, atol=1e-6)


@pytest.mark.parametrize("case", ["repetition_up", "repetition_down", "frequency", "presence",
                                  "negative_penalties", "combo", "logit_bias", "min_tokens"])
def test_penalties_processed_logits_vs_reference(case):
    vocab = 64
    logits, params, prompts, outputs = build_case_batch(CASES[case], vocab, 31,
                                                        [{"temperature": 1.0}] * 5)
    for p in params:
        p.logprobs = -1
    out, _ = run_sampler(logits, params, prompts, outputs, mode="processed_logits",
                         config=full_config(vocab, len(params)))
    for i in range(len(params)):
        ref = reference_row(logits[i], params[i], prompts[i], outputs[i])
        assert_vectors_close(full_vector(out, i, vocab), ref.constrained, atol=1e-5,
                             what=f"row {i}")


def test_min_tokens_by_hand():
    row = torch.tensor([0.0, 1.0, 6.0, 5.0, 4.0, 3.0])
    base = dict(temperature=0.0, eos_token_ids=[2], stop_token_ids=[3], min_tokens=3)
    cases = [
        (SamplingParams(**base), [1], 4),  # 2 (eos) and 3 (stop) banned
        (SamplingParams(**base, ignore_eos=True), [1], 2),  # eos allowed
        (SamplingParams(**base), [1, 1, 1], 2),  # min reached
        (SamplingParams(**{**base, "min_tokens": 0}), [], 2),
    ]
    out, _ = run_sampler(row.repeat(len(cases), 1), [c[0] for c in cases],
                         outputs=[c[1] for c in cases])
    assert out.sampled_token_ids.tolist() == [c[2] for c in cases]


def test_thinking_budget_forces_the_end_token():
    vocab = 12
    holder = ThinkingBudgetStateHolder(
        ReasoningConfig(reasoning_start_token_ids=[1], reasoning_end_token_ids=[2]),
        max_num_seqs=4, num_spec_tokens=0, device="cpu", is_pin_memory=False)
    logits = make_logits(4, vocab, 21)
    logits[:, 2] = -10.0  # the end token would never be chosen freely
    params = [
        SamplingParams(temperature=0.0, thinking_token_budget=2),  # budget spent: forced
        SamplingParams(temperature=1.0, thinking_token_budget=2, top_k=3),  # forced
        SamplingParams(temperature=0.0, thinking_token_budget=5),  # not yet
        SamplingParams(temperature=0.0),  # untracked
    ]
    prompts = [[5, 1], [5, 1], [5, 1], [5, 1]]
    outputs = [[6, 7], [6, 7], [6, 7], [6, 7]]
    out, _ = run_sampler(logits, params, prompts, outputs, thinking_budget=holder)
    toks = out.sampled_token_ids.tolist()
    assert toks[0] == 2 and toks[1] == 2
    assert toks[2] == reference_row(logits[2], params[2], prompts[2], outputs[2]).greedy_token
    assert toks[3] == reference_row(logits[3], params[3], prompts[3], outputs[3]).greedy_token
    # the reference with the forced token agrees
    assert reference_row(logits[0], params[0], forced_token=2).greedy_token == 2


# -- empirical frequencies --------------------------------------------------------------

STAT_KNOBS = [
    ({"temperature": 1.0}, "plain"),
    ({"temperature": 0.5}, "plain"),
    ({"temperature": 1.4, "top_k": 6}, "plain"),
    ({"temperature": 1.0, "top_p": 0.75}, "plain"),
    ({"temperature": 0.9, "min_p": 0.1}, "plain"),
    ({"temperature": 1.1, "top_k": 15, "top_p": 0.9, "min_p": 0.03}, "combo"),
    ({"temperature": 0.8}, "frequency"),
    ({"temperature": 1.0, "top_p": 0.6}, "bad_words"),
]


@pytest.mark.statistical
@pytest.mark.parametrize("knobs,case", STAT_KNOBS, ids=[f"{c}-{i}" for i, (_, c) in enumerate(STAT_KNOBS)])
def test_empirical_frequencies_match_reference(knobs, case):
    vocab = 40
    rows, calls = 4000, 5
    rng = random.Random(3)
    row = make_logits(1, vocab, 1234)[0]
    kw, prompt, output = CASES[case](row, rng)
    params = SamplingParams(**kw, **knobs)
    ref = reference_row(row, params, prompt, output)
    torch.manual_seed(0)
    tokens: list[int] = []
    for _ in range(calls):
        out, _ = run_sampler(row.repeat(rows, 1), [params] * rows, [prompt] * rows,
                             [output] * rows)
        tokens += out.sampled_token_ids.tolist()
    assert set(tokens) <= ref.support
    n = rows * calls
    tv = tv_distance(empirical(tokens, vocab), ref.probs)
    bound = max(0.01, 2.0 * expected_tv(ref.probs, n))
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


@pytest.mark.statistical
@pytest.mark.parametrize("knobs", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}])
def test_empirical_frequencies_large_vocabulary(knobs):
    """vocab 6000 (several sampling blocks, a partial last one): the mass sits on a few
    tokens spread over the blocks, including the last, partial block."""
    vocab, rows, calls = 6000, 4000, 5
    hot = [3, 1023, 1024, 2500, 4100, 5119, 5120, 5999]
    row = torch.full((vocab,), -30.0)
    row += make_logits(1, vocab, 5, scale=0.5)[0]
    row[hot] = torch.tensor([1.0, 0.2, 1.5, 0.7, 0.9, 0.3, 1.1, 0.6])
    params = SamplingParams(**knobs)
    ref = reference_row(row, params)
    torch.manual_seed(2)
    tokens: list[int] = []
    for _ in range(calls):
        out, _ = run_sampler(row.repeat(rows, 1), [params] * rows)
        tokens += out.sampled_token_ids.tolist()
    assert set(tokens) <= ref.support
    n = rows * calls
    tv = tv_distance(empirical(tokens, vocab), ref.probs)
    bound = max(0.01, 2.0 * expected_tv(ref.probs, n))
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


@pytest.mark.statistical
def test_seeded_rows_follow_the_reference_distribution():
    """Seeded rows draw from their own generators; across many seeds their tokens follow
    the reference distribution too."""
    vocab, n = 24, 12000
    row = make_logits(1, vocab, 77)[0]
    ref_params = SamplingParams(temperature=0.8, top_p=0.9)
    ref = reference_row(row, ref_params)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(n)]
    out, _ = run_sampler(row.repeat(n, 1), params)
    tokens = out.sampled_token_ids.tolist()
    assert set(tokens) <= ref.support
    tv = tv_distance(empirical(tokens, vocab), ref.probs)
    assert tv < max(0.015, 2.0 * expected_tv(ref.probs, n))


# -- logprobs ---------------------------------------------------------------------------

MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def reference_values(ref, mode):
    if mode == "raw_logprobs":
        return ref.raw_logprobs
    if mode == "raw_logits":
        return ref.raw_logits
    if mode == "processed_logprobs":
        return ref.processed_logprobs
    return ref.final_logits


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_modes_against_reference(mode):
    vocab = 200
    rng = random.Random(9)
    knobs = [
        {"temperature": 0.0, "logprobs": 5},
        {"temperature": 1.0, "logprobs": 3},
        {"temperature": 0.7, "top_k": 8, "logprobs": 10},
        {"temperature": 1.3, "top_p": 0.8, "logprobs": 0},
        {"temperature": 1.0, "logprobs": None},
        {"temperature": 0.9, "top_k": 4, "logprobs": 6},  # k > support: -inf tail
        {"temperature": 1.0, "min_p": 0.05, "logprobs": 2},
        {"temperature": 0.0, "logprobs": 1},
    ]
    names = ["presence", "combo", "plain", "logit_bias", "plain", "repetition_up",
             "frequency", "bad_words"]
    logits = make_logits(len(knobs), vocab, 41)
    params, prompts, outputs = [], [], []
    for i, k in enumerate(knobs):
        kw, prompt, output = CASES[names[i]](logits[i], rng)
        params.append(SamplingParams(**kw, **k))
        prompts.append(prompt)
        outputs.append(output)
    torch.manual_seed(1)
    out, _ = run_sampler(logits, params, prompts, outputs, mode=mode)
    lt = out.logprobs_tensors
    assert lt is not None
    assert lt.token_ids.shape == (len(knobs), 11) == lt.logprobs.shape
    for i, p in enumerate(params):
        ref = reference_row(logits[i], p, prompts[i], outputs[i])
        sampled = out.sampled_token_ids[i].item()
        if ref.is_greedy:
            assert sampled == ref.greedy_token
        else:
            assert sampled in ref.support
        if p.logprobs is None:
            continue
        values = reference_values(ref, mode)
        # sampled token first, with its value and rank
        assert lt.token_ids[i, 0].item() == sampled
        assert_vectors_close([lt.logprobs[i, 0].item()], [values[sampled]], what=f"row {i}")
        assert lt.ranks[i].item() == sum(1 for v in values if v >= values[sampled]), f"row {i}"
        # then the top-k, sorted descending
        k = p.logprobs
        order = sorted(range(vocab), key=lambda t: -values[t])[:k]
        got_ids = lt.token_ids[i, 1: k + 1].tolist()
        got_vals = lt.logprobs[i, 1: k + 1].tolist()
        assert_vectors_close(got_vals, [values[t] for t in order], what=f"row {i}")
        assert got_vals == sorted(got_vals, reverse=True)
        finite = [t for t in order if values[t] != NEG_INF]
        assert got_ids[: len(finite)] == finite, f"row {i}"
        if mode.startswith("raw"):
            assert len(finite) == k


def test_no_logprobs_tensors_when_no_row_asks():
    logits = make_logits(3, 20, 2)
    out, _ = run_sampler(logits, [SamplingParams(), SamplingParams(temperature=0.0),
                                  SamplingParams(top_k=3)])
    assert out.logprobs_tensors is None
    assert out.sampled_token_ids.shape == (3,)


def test_raw_logprobs_rank_of_a_penalised_greedy_token():
    """Rank counts tokens whose (raw) logprob is >= the sampled token's."""
    row = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: -10.0, 1: -10.0})
    out, _ = run_sampler(row.unsqueeze(0), [params], mode="raw_logprobs")
    lt = out.logprobs_tensors
    assert out.sampled_token_ids.tolist() == [2]
    assert lt.ranks.tolist() == [3]
    assert lt.token_ids[0].tolist() == [2, 0, 1]
    lp = torch.log_softmax(row.double(), -1)
    assert torch.allclose(lt.logprobs[0].double(), lp[[2, 0, 1]], atol=1e-6)


# -- seeded rows ------------------------------------------------------------------------


def _seeded_steps(vocab, step_logits, target, neighbours, position, steps):
    """Runs ``steps`` steps of a batch where ``target`` (a SamplingParams with a seed) sits
    at ``position`` among ``neighbours``; returns the target's tokens."""
    n = len(neighbours) + 1
    batch_params = list(neighbours)
    batch_params.insert(position, target)
    outputs = [[] for _ in range(n)]
    generators = None
    tokens = []
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 + s)
        logits = torch.randn(n, vocab, generator=g) * 3.0  # neighbours change every step
        logits[position] = step_logits[s]
        out, md = run_sampler(logits, batch_params, [[1, 2]] * n, outputs,
                              generators=generators)
        toks = out.sampled_token_ids.tolist()
        for i in range(n):
            outputs[i].append(toks[i])
        tokens.append(toks[position])
        generators = md.generators
    return tokens


@pytest.mark.parametrize("vocab", [64, 3000])
def test_seeded_row_is_reproducible_across_batches(vocab):
    steps = 6
    g = torch.Generator().manual_seed(5)
    step_logits = torch.randn(steps, vocab, generator=g) * 0.3  # flat-ish: many choices
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234,
                            presence_penalty=0.1)
    big_k = min(2000, vocab - 1)
    layouts = [
        ([], 0),
        ([SamplingParams(temperature=0.0), SamplingParams(),
          SamplingParams(seed=99, top_k=3)], 2),
        ([SamplingParams(top_k=big_k), SamplingParams(seed=1234, temperature=0.5),
          SamplingParams(temperature=0.0, logprobs=2), SamplingParams(top_p=0.3),
          SamplingParams(min_p=0.2), SamplingParams(), SamplingParams()], 5),
        ([SamplingParams(temperature=0.0)] * 3, 3),
    ]
    runs = []
    for neighbours, position in layouts:
        torch.manual_seed(len(runs))  # the global generator differs between runs
        runs.append(_seeded_steps(vocab, step_logits, target, neighbours, position, steps))
    assert all(r == runs[0] for r in runs), runs
    # the stream continues (a fresh generator each step would repeat the first draw's
    # uniform); a different seed gives a different sequence
    other = _seeded_steps(vocab, step_logits, target.clone(seed=4321), [], 0, steps)
    assert other != runs[0]


def test_seeded_stream_continues_with_passed_generators():
    """Step 2 with the generators of step 1 equals drawing two uniforms in a row from
    a generator seeded with the seed (inverse-CDF with one uniform per step is not
    assumed; only that the stream is not restarted)."""
    vocab = 64
    row = torch.zeros(vocab)  # uniform: the token reveals the draw
    params = [SamplingParams(seed=7)]
    first, md = run_sampler(row.unsqueeze(0), params)
    second, _ = run_sampler(row.unsqueeze(0), params, generators=md.generators)
    restarted, _ = run_sampler(row.unsqueeze(0), params)
    assert restarted.sampled_token_ids.tolist() == first.sampled_token_ids.tolist()
    # with 64 equally likely tokens, a continued stream repeating the first token for
    # several steps is very unlikely; check over a few steps
    toks = [first.sampled_token_ids.item(), second.sampled_token_ids.item()]
    gens = md.generators
    for _ in range(4):
        out, md2 = run_sampler(row.unsqueeze(0), params, generators=gens)
        toks.append(out.sampled_token_ids.item())
        gens = md2.generators
    assert len(set(toks)) > 1
