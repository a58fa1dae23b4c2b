"""A 65,536-token shared prefix (4,096 blocks of 16) through the real engine on a tiny
random model: the n = 4 samples of one request compute it once (sample 0) and the other
three take all of its blocks from the prefix cache, and a second request with the same
prefix and its own question takes them too. Content keys that nested every earlier key
raised RecursionError from about 1,000 blocks; digests cost the same at any depth.

The cost is the first prefill's attention over the long context (the model is 2 layers
of hidden 64): about half a minute on 2 cores."""

from __future__ import annotations

import random

import pytest

from cluster import LLM
from sampler.params import SamplingParams
from tiny_model import build_tiny_model

BS = 16
PREFIX = 65_536
VOCAB = 400


@pytest.fixture(scope="module")
def long_model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama-70k"), max_position_embeddings=70_000))


def test_a_65k_token_prefix_is_computed_once_and_hit_by_every_other_reader(ray_local, long_model_path):
    rng = random.Random(65)
    prefix = [rng.randrange(3, VOCAB) for _ in range(PREFIX)]
    first = prefix + [rng.randrange(3, VOCAB) for _ in range(7)]
    second = prefix + [rng.randrange(3, VOCAB) for _ in range(11)]
    params = SamplingParams(temperature=0.0, n=4, max_tokens=2, ignore_eos=True, logprobs=1)
    llm = LLM(long_model_path, max_num_seqs=8, max_model_len=PREFIX + 64, kv_cache_tokens=PREFIX + 64 * BS,
              max_num_batched_tokens=8192, worker_num_cpus=1)
    try:
        blocks = llm.engine.workers[0].scheduler.blocks
        (a,) = llm.generate([first], params, use_tqdm=False)
        # Samples 1-3 waited for sample 0's prompt blocks, then took every full block
        # before the last prompt token: the whole prefix (the 7-token tail is no full block).
        assert a.num_cached_tokens == PREFIX
        assert blocks.num_hit_tokens == 3 * PREFIX
        assert blocks.num_queried_tokens == 4 * len(first)
        # Greedy: the samples that read the cached KV agree with the one that computed it.
        outs = a.outputs
        assert all(o.token_ids == outs[0].token_ids for o in outs)
        for o in outs[1:]:
            assert o.logprobs.logprobs == pytest.approx(outs[0].logprobs.logprobs, abs=1e-4)

        (b,) = llm.generate([second], params.clone(n=1), use_tqdm=False)
        assert b.num_cached_tokens == PREFIX
        assert blocks.num_hit_tokens == 4 * PREFIX
        assert blocks.num_queried_tokens == 4 * len(first) + len(second)
        assert len(b.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
