"""The blocked top-k against ``torch.topk``: same values (sorted or as a set), indices
that hold those values, on random rows with ties, -inf stretches and ragged tails."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_budget import examples
from sampler.ops.topk import block_size, topk


@st.composite
def rows_and_k(draw):
    rows = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([4096, 5000, 8192, 12345]))
    k = draw(st.integers(1, vocab // 256))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "few_values", "masked", "peaked"]))
    if kind == "few_values":  # heavy ties, at the k-th value too
        x = torch.randint(0, 4, (rows, vocab), generator=gen).float()
    else:
        x = torch.randn(rows, vocab, generator=gen)
    if kind == "masked":  # most of each row banned: fewer finite values than k, maybe
        keep = torch.rand(rows, vocab, generator=gen) < draw(st.sampled_from([0.0005, 0.01, 0.5]))
        x = x.masked_fill(~keep, float("-inf"))
    if kind == "peaked":
        x[:, torch.randint(0, vocab, (8,), generator=gen)] += 20
    return x, k


@settings(max_examples=examples(150), deadline=None)
@given(rows_and_k(), st.booleans())
def test_blocked_topk_matches_torch(case, sort):
    x, k = case
    assert block_size(x.shape[1], k) is not None  # the blocked path is what runs
    want_vals, _ = x.topk(k, dim=-1, sorted=True)
    vals, ids = topk(x, k, sorted=sort)
    assert vals.shape == ids.shape == (x.shape[0], k)
    if sort:
        assert torch.equal(vals, want_vals)
    else:
        assert torch.equal(vals.sort(dim=-1, descending=True).values, want_vals)
    assert torch.equal(x.gather(1, ids), vals)  # each index holds its value
    assert all(len(set(r)) == k for r in ids.tolist())  # no token twice


def test_small_vocabularies_and_wide_k_fall_back_to_torch():
    assert block_size(1000, 5) is None and block_size(49152, 1024) is None
    x = torch.randn(3, 49152)
    vals, ids = topk(x, 1024)
    assert torch.equal(vals, x.topk(1024, dim=-1).values)
    with pytest.raises(ValueError):
        topk(x[0], 3)


def test_strided_rows_are_handled():
    x = torch.randn(8, 20000)[::2]  # rows apart in memory, each row contiguous
    vals, _ = topk(x, 7)
    assert torch.equal(vals, x.topk(7, dim=-1).values)
    y = torch.randn(20000, 4).t()  # columns: not contiguous within a row
    assert torch.equal(topk(y, 7)[0], y.topk(7, dim=-1).values)
