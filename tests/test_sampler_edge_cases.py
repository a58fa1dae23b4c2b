"""Edge cases found in review: empty batches, constraints that ban every token,
zero-mass drafts, logprobs wider than the vocabulary, top-k over few finite logits."""

from __future__ import annotations

import pytest
import torch

from sampler.metadata import SamplingMetadata
from sampler.params import SamplingParams
from sampler.rejection_sampler import RejectionSampler
from sampler.sampler import Sampler


def metadata(params, vocab, outputs=None, **kw):
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.from_requests(params, [[1]] * len(params), outputs, vocab, **kw)


def test_empty_batch_returns_no_tokens():
    out = Sampler()(torch.randn(0, 10), metadata([], 10))
    assert out.sampled_token_ids.shape == (0,)
    assert out.logprobs_tensors is None


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_row_banning_every_token_is_flagged_and_neighbours_unharmed(top_p):
    vocab = 5000
    dead = SamplingParams(allowed_token_ids=[2], bad_words=["x"], top_p=top_p, seed=1)
    dead.bad_words_token_ids = [[2]]
    params = [dead, SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, metadata(params, vocab))
    assert out.unsatisfiable_rows == [0]
    assert out.sampled_token_ids[1:].tolist() == logits[1:].argmax(dim=-1).tolist()


def test_verify_rejects_allowed_tokens_that_min_tokens_bans():
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[2], min_tokens=1, eos_token_ids=[2]).verify(10)
    SamplingParams(allowed_token_ids=[2, 3], min_tokens=1, eos_token_ids=[2]).verify(10)


def test_verify_rejects_logprobs_wider_than_the_vocabulary():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=15).verify(10)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=15).verify(10)


def test_rejection_never_accepts_a_draft_its_proposer_gave_no_mass():
    vocab = 10
    md = metadata([SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3])], vocab)
    q = torch.zeros(1, vocab)
    q[0, 1] = 1.0  # token 7 was not proposable, and it is banned
    for _ in range(50):
        out = RejectionSampler()([[7]], q, torch.randn(1, vocab), torch.tensor([1]), md)
        assert out[0, 0].item() in (1, 2, 3)
        assert out[0, 1].item() == -1


def test_top_k_with_fewer_finite_logits_than_k():
    """min-p leaves 3 finite logits, top-k is 50: the three survive, nothing else."""
    vocab = 3000
    logits = torch.full((1, vocab), -30.0)
    logits[0, [5, 6, 7]] = torch.tensor([10.0, 9.5, 9.0])
    params = [SamplingParams(top_k=50, min_p=0.1, logprobs=5)]
    seen = set()
    for seed in range(200):
        params[0].seed = seed
        seen.add(int(Sampler()(logits, metadata(params, vocab)).sampled_token_ids[0]))
    assert seen == {5, 6, 7}


def test_logit_bias_applies_at_the_bonus_position():
    """With drafts, the bonus-position logits still get each row's bias."""
    vocab = 20
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=0.0)]
    logits = torch.zeros(2, vocab)
    logits[:, 9] = 5.0
    md = metadata(params, vocab, spec_token_ids=[[4, 4], []])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [3, 9]


def test_penalties_on_a_non_contiguous_view_change_the_viewed_tensor():
    """apply_penalties works in place through flat indices; a strided view (every other
    vocabulary column) must get exactly what a contiguous copy gets."""
    import numpy as np

    from sampler.ops.penalties import apply_penalties

    base = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    view = base[:, ::2]  # [3, 20], not contiguous
    assert not view.is_contiguous()
    prompts, outputs = [[1, 2, 2], [], [19]], [[3, 3, 3, 1], [0, 0], []]
    args = (np.array([1.5, 1.0, 0.7], np.float32), np.array([0.3, 0.2, 0.0], np.float32),
            np.array([0.1, 0.0, 0.4], np.float32))
    want = apply_penalties(view.contiguous(), prompts, outputs, *args)
    got = apply_penalties(view, prompts, outputs, *args)
    assert got.data_ptr() == view.data_ptr()
    torch.testing.assert_close(base[:, ::2], want)
    torch.testing.assert_close(got, want)
