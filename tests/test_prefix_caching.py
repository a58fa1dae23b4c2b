"""The paged KV cache end to end on tiny random models: greedy output equal to
transformers ``generate`` with prefix caching on and off, caching that never changes a
result (tokens, logprobs, prompt logprobs), ``num_cached_tokens``, the ``n`` samples of a
request computing their prompt once, a pool too small for the batch (preemption), routing
to the worker that holds a prefix, and the attention features: sliding windows
(Mistral), soft-capped logits with sliding and global layers (Gemma 2), attention sinks
with sliding and global layers (gpt-oss), all equal to transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM
from helpers import assert_greedy_equal, generate, prompts
from sampler.params import SamplingParams
from tiny_model import build_tiny_model

VOCAB = 400
BS = 16
SYSTEM = prompts(VOCAB, [70], seed=50)[0]  # 4 full blocks and a part
SUFFIXES = prompts(VOCAB, [9, 25, 4, 40, 17, 31], seed=51)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)


def run_waves(llm: LLM, params: SamplingParams, waves: int = 2) -> list:
    """The shared-prefix prompts, in waves (a later wave finds the earlier ones' blocks)."""
    out = []
    for _ in range(waves):
        out += llm.generate([SYSTEM + s for s in SUFFIXES], params, use_tqdm=False)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(ray_local, tiny_model_path):
    common = dict(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64, worker_num_cpus=1)
    cached = LLM(tiny_model_path, **common)
    plain = LLM(tiny_model_path, enable_prefix_caching=False, **common)
    yield cached, plain
    cached.shutdown()
    plain.shutdown()


def test_caching_changes_no_result_and_matches_generate(engines, reference):
    cached, plain = engines
    got, want = run_waves(cached, GREEDY), run_waves(plain, GREEDY)
    assert [o.num_cached_tokens for o in want] == [0] * len(want)
    # The second wave took the system prompt's full blocks (at least) from the cache.
    assert all(o.num_cached_tokens >= len(SYSTEM) // BS * BS for o in got[len(SUFFIXES):])
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs.logprobs == pytest.approx(w.outputs[0].logprobs.logprobs, abs=1e-5)
    for o in got[: len(SUFFIXES)]:
        p = o.prompt_token_ids
        assert_greedy_equal(reference, p, o.outputs[0].token_ids, generate(reference, p, 20))


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(engines):
    cached, plain = engines
    cached.generate([SYSTEM + SUFFIXES[0]], GREEDY, use_tqdm=False)  # the prefix is now cached
    params = GREEDY.clone(prompt_logprobs=2)
    (got,) = cached.generate([SYSTEM + SUFFIXES[1]], params, use_tqdm=False)
    (want,) = plain.generate([SYSTEM + SUFFIXES[1]], params, use_tqdm=False)
    assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
    assert got.prompt_logprobs.token_ids == want.prompt_logprobs.token_ids
    assert got.prompt_logprobs.logprobs == pytest.approx(want.prompt_logprobs.logprobs, abs=1e-5)


def test_the_n_samples_of_a_request_compute_their_prompt_once(engines):
    cached, plain = engines
    blocks = cached.engine.workers[0].scheduler.blocks
    prompt = prompts(VOCAB, [90], seed=60)[0]  # 5 full blocks and a part, never seen before
    hits_before = blocks.num_hit_tokens
    params = SamplingParams(temperature=0.8, seed=5, n=4, max_tokens=12, ignore_eos=True)
    (got,) = cached.generate([prompt], params, use_tqdm=False)
    (want,) = plain.generate([prompt], params, use_tqdm=False)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    # samples 1-3 each found sample 0's full prompt blocks
    assert blocks.num_hit_tokens - hits_before == 3 * ((len(prompt) - 1) // BS * BS)
    assert got.num_cached_tokens == (len(prompt) - 1) // BS * BS


def test_a_pool_too_small_for_the_batch_preempts_and_finishes_everything(ray_local, tiny_model_path, engines):
    _, plain = engines
    want = run_waves(plain, GREEDY, waves=1)
    tight = LLM(tiny_model_path, max_num_seqs=6, max_model_len=512, max_num_batched_tokens=64,
                kv_cache_tokens=16 * 16, worker_num_cpus=1)
    try:
        got = run_waves(tight, GREEDY, waves=1)
        assert tight.engine.workers[0].scheduler.num_preemptions > 0
        assert tight.engine.workers[0].info.num_kv_blocks == 16
    finally:
        tight.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_requests_go_to_the_worker_that_holds_their_prefix(ray_local, tiny_model_path):
    llm = LLM(tiny_model_path, num_workers=2, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=128,
              worker_num_cpus=1)
    try:
        engine = llm.engine
        llm.generate([SYSTEM + SUFFIXES[0]], GREEDY, use_tqdm=False)
        holder = next(w for w in engine.workers if w.scheduler.blocks.cached)
        other = next(w for w in engine.workers if w is not holder)
        outs = llm.generate([SYSTEM + s for s in SUFFIXES[1:4]], GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens >= len(SYSTEM) // BS * BS for o in outs)
        stats = {s["worker"]: s for s in engine.prefix_cache_stats()}
        assert stats[holder.index]["hits"] >= 3 * (len(SYSTEM) // BS * BS)
        assert stats[other.index]["hits"] == 0
    finally:
        llm.shutdown()


# -- attention features ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gpt_oss"])
def test_sliding_windows_softcaps_and_sinks_match_transformers(ray_local, tmp_path_factory, arch):
    """Prompts longer than the window (24 tokens): the paged path must apply it, in the
    batched decode and the chunked prefill alike, and Gemma 2's capped logits, gpt-oss's
    sinks."""
    path = str(build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts(VOCAB, [5, 30, 70, 12], seed=70)
    llm = LLM(path, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32, worker_num_cpus=1)
    try:
        outs = llm.generate(ps, GREEDY.clone(logprobs=None, max_tokens=30), use_tqdm=False)
    finally:
        llm.shutdown()
    for p, o in zip(ps, outs):
        assert_greedy_equal(ref, p, o.outputs[0].token_ids, generate(ref, p, 30))
