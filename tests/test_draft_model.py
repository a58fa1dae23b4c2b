"""Draft-model speculative decoding (``speculative_config`` method ``draft_model``).

Every test compares against the target alone (transformers or the worker without
drafts), never against the draft: a draft may say anything, the target's verification
keeps its outputs. Drafts: a random model of the same vocabulary (its own KV pool,
rejected nearly always), the target's own weights quantized (``self``, on the target's
KV, accepted often), and hostile ones refused before anything starts.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import SEEDED, assert_greedy_equal, make_worker, prompts, run_alone_and_mixed
from sampler.params import SamplingParams
from tiny_model import build_tiny_model
from worker.runner.model_loader import ModelLoadError
from worker_driver import MiniDriver, Req

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def draft_config(model: str, k: int = 4, **extra) -> dict:
    # Every batch drafts (the default turns drafting off from 5 rows; some tests run 8).
    return {"speculative_config": {"method": "draft_model", "model": model, "num_speculative_tokens": k,
                                   "disable_by_batch_size": 99, **extra}}


def self_draft(scheme: str = "int8", k: int = 4, **extra) -> dict:
    return draft_config("self", k, quantization=scheme, **extra)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    """Another random model on the tiny target's tokenizer (its own weights: its own KV)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1))


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def run(worker, ps, params=GREEDY, max_rows=4, **driver):
    d = MiniDriver(worker.step, max_rows=max_rows, token_budget=64, **driver)
    for i, p in enumerate(ps):
        d.submit(f"r{i}", p, params, arrival_step=i)
    done = d.run()
    return d, done


@pytest.mark.parametrize("draft", ["random", "self-int8", "self-int4"])
def test_greedy_equals_the_target_alone(tiny_model_path, random_draft, reference, draft):
    """Rows in prefill, decoding and drafting share steps; outputs equal the target's."""
    ps = prompts(400, [6, 30, 12, 50, 3], seed=3)
    config = {"random": draft_config(random_draft), "self-int8": self_draft("int8"),
              "self-int4": self_draft("int4", quantization_config={"group_size": 32})}[draft]
    _, plain = run(make_worker(tiny_model_path), ps)
    d, spec = run(make_worker(tiny_model_path, **config), ps)
    drafted = sum(r.num_drafts for r in spec.values())
    accepted = sum(r.num_accepted for r in spec.values())
    assert drafted > 0
    if draft.startswith("self"):  # the target's own weights: most drafts hold
        assert accepted > drafted // 3
        assert d.step_id < max(len(r.output) for r in plain.values()) + len(ps) * 2
    for i, p in enumerate(ps):
        assert len(spec[f"r{i}"].output) == 32
        assert_greedy_equal(reference, p, spec[f"r{i}"].output, plain[f"r{i}"].output)


def test_the_draft_catches_up_after_steps_without_drafts(tiny_model_path, random_draft, reference):
    """With its own KV, a row that ran steps without drafting (the batch at the limit)
    has its draft catch up on everything the target accepted meanwhile."""
    ps = prompts(400, [20, 9, 14], seed=5)
    outs = []
    for config in ({}, draft_config(random_draft, 3, disable_by_batch_size=2)):
        # Rows arrive one a step and end at 8, 16 and 40 tokens: nobody drafts while two
        # or more run, then r2, alone, catches up on all it generated meanwhile.
        d = MiniDriver(make_worker(tiny_model_path, **config).step, max_rows=4, token_budget=64)
        for i, (p, n) in enumerate(zip(ps, (8, 16, 40))):
            d.submit(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), arrival_step=i)
        outs.append(d.run())
    plain, spec = outs
    for i, p in enumerate(ps):
        assert_greedy_equal(reference, p, spec[f"r{i}"].output, plain[f"r{i}"].output)
    assert spec["r1"].num_drafts == 0 and spec["r2"].num_drafts > 0


@pytest.mark.parametrize("k", [1, 3])
def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_path, k):
    new = lambda: make_worker(tiny_model_path, **self_draft("int8", k)).step
    prompt = prompts(400, [6], seed=3)[0] * 3
    alone, mixed = run_alone_and_mixed(new, SEEDED, prompt)
    assert alone == mixed


@pytest.mark.parametrize("draft", ["ngram", "random", "self-int8"])
def test_a_resumed_request_continues_its_seeded_stream(tiny_model_path, random_draft, draft):
    """Preempted or moved off a lost worker after a few steps, a seeded request resumes
    on a fresh worker with its output and generator draws, recomputes all but its last
    token, decodes that one with the drafts it had there: the same tokens as undisturbed."""
    config = {"ngram": {"num_spec_tokens": 3}, "random": draft_config(random_draft, 3),
              "self-int8": self_draft("int8", 3)}[draft]
    ps = [b * 6 for b in prompts(400, [6, 4, 9, 5], seed=11)] + prompts(400, [30, 12], seed=12)
    new = lambda: make_worker(tiny_model_path, max_num_seqs=8, **config).step
    whole = MiniDriver(new(), max_rows=8)
    for i, p in enumerate(ps):
        whole.submit(f"r{i}", p, SEEDED.clone(seed=i))
    reference = whole.run()
    drafted = 0
    for steps in (3, 7):
        first = MiniDriver(new(), max_rows=8)
        for i, p in enumerate(ps):
            first.submit(f"r{i}", p, SEEDED.clone(seed=i))
        for _ in range(steps):
            first.step()
        drafted += sum(r.num_drafts for r in first.rows)
        second = MiniDriver(new(), max_rows=8, resume_last_alone=True)
        second.waiting = [Req(r.request_id, r.prompt, r.params, output=list(r.output), draws=r.draws)
                          for r in first.rows + first.waiting]
        resumed = second.run()
        assert {k: r.output for k, r in resumed.items()} == {k: r.output for k, r in reference.items()}
    assert drafted  # drafts were verified before the cut


def test_logprobs_and_penalties_under_a_draft(tiny_model_path):
    """Logprobs of the emitted tokens come from the target's logits at each position:
    the same as without drafts; a repetition penalty acts at every draft position."""
    ps = prompts(400, [7, 19], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3, repetition_penalty=1.3)
    _, plain = run(make_worker(tiny_model_path), ps, params)
    _, spec = run(make_worker(tiny_model_path, **self_draft("int8")), ps, params)
    assert sum(r.num_accepted for r in spec.values()) > 0
    for rid in plain:
        assert spec[rid].output == plain[rid].output
        for (ids_a, lp_a, rank_a), (ids_b, lp_b, rank_b) in zip(spec[rid].logprobs, plain[rid].logprobs, strict=True):
            assert ids_a == ids_b and rank_a == rank_b
            np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)


def test_a_draft_that_fails_leaves_the_step_to_the_target(tiny_model_path, reference, caplog):
    worker = make_worker(tiny_model_path, **self_draft("int8"))
    draft = worker._runner.draft

    def broken(*args):
        raise RuntimeError("the draft's kernel fell over")

    draft._propose = broken
    ps = prompts(400, [8, 15], seed=2)
    with caplog.at_level(logging.ERROR, logger="raydecode"):
        _, spec = run(worker, ps)
    _, plain = run(make_worker(tiny_model_path), ps)
    for i, p in enumerate(ps):
        assert spec[f"r{i}"].error is None and spec[f"r{i}"].num_drafts == 0
        assert_greedy_equal(reference, p, spec[f"r{i}"].output, plain[f"r{i}"].output)
    assert sum("draft model" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records) == 1


def test_drafting_stops_at_the_batch_size_limit(tiny_model_path):
    ps = prompts(400, [5, 6, 7], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    worker = make_worker(tiny_model_path, **self_draft("int8", 2, disable_by_batch_size=3))
    d = MiniDriver(worker.step, max_rows=4)
    for i, p in enumerate(ps):
        d.submit(f"r{i}", p, params)  # all three at once: every step has 3 rows
    assert sum(r.num_drafts for r in d.run().values()) == 0


@pytest.mark.statistical
@pytest.mark.parametrize("draft", ["random", "self-int8"])
def test_sampled_tokens_follow_the_target_distribution(tiny_model_path, random_draft, reference, draft):
    """Temperature 1 (with top-k 8): the token after the first, drafted by the draft and
    verified by the rejection sampler, follows the target's exact marginal (computed with
    transformers over every first token): a chi-square test over 2,400 seeded requests."""
    config = draft_config(random_draft, 2) if draft == "random" else self_draft("int8", 2)
    prompt = prompts(400, [9], seed=21)[0]
    params = dict(temperature=1.0, top_k=8, max_tokens=3, ignore_eos=True)
    # The exact marginal of the second token.
    with torch.inference_mode():
        first = torch.softmax(_top_k(reference(torch.tensor([prompt])).logits[0, -1], 8), -1)
        t1 = torch.nonzero(first).flatten()
        batch = torch.tensor([prompt + [int(t)] for t in t1])
        second = torch.softmax(_top_k(reference(batch).logits[:, -1], 8), -1)
        marginal = (first[t1, None] * second).sum(0).numpy()
    worker = make_worker(tiny_model_path, max_num_seqs=8, **config)
    d = MiniDriver(worker.step, max_rows=8)
    n = 2400
    for i in range(n):
        d.submit(f"s{i}", prompt, SamplingParams(seed=1000 + i, **params))
    done = d.run()
    assert sum(r.num_drafts for r in done.values()) >= n // 2
    counts = np.bincount([r.output[1] for r in done.values()], minlength=len(marginal))
    statistic, limit = _chi_square(counts, marginal)
    assert statistic < limit, f"chi-square {statistic:.1f} >= {limit:.1f}: not the target's distribution"
    # The test can fail: the first token's distribution is not the second's.
    wrong, limit = _chi_square(counts, first.numpy())
    assert wrong > limit


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson's statistic of ``counts`` against ``probs`` (cells expecting under 5
    pooled), and its critical value at p = 0.001 (Wilson-Hilferty)."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    observed, exp = observed[keep], exp[keep]
    statistic = float(((observed - exp) ** 2 / exp).sum() + (observed[exp == 0].sum() > 0) * 1e9)
    df = len(exp) - 1
    z = 3.09  # the normal quantile at 0.999
    return statistic, df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


# -- refused before anything starts ------------------------------------------------------


def _with_edited_vocab(src: str, dst: Path) -> str:
    """A copy of the tiny model whose tokenizer maps two tokens the other way round."""
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return str(dst)


def test_hostile_drafts_are_refused_at_load(tiny_model_path, tmp_path):
    bigger = str(build_tiny_model(tmp_path / "big", hidden_size=128, intermediate_size=256))
    other_vocab = str(build_tiny_model(tmp_path / "vocab", vocab_size=512))
    cases = [
        (draft_config(bigger), r"more parameters \([\d,]+\) than the target"),
        (draft_config(other_vocab), r"512 logits per token, the target \d+: a draft must share"),
        (draft_config(_with_edited_vocab(tiny_model_path, tmp_path / "tok")), "another tokenizer"),
        (draft_config(str(tmp_path / "missing")), r"speculative_config\.model: model path .* does not exist"),
    ]
    for config, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            make_worker(tiny_model_path, **config)
    with pytest.raises(ModelLoadError, match="a 'self' draft quantizes the target's float weights, but .* runs "
                                             "quantized already"):
        make_worker(tiny_model_path, quantization="int8", **self_draft("int4"))


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 0},
     r"num_speculative_tokens: must be from 1 to 16, got 0"),
    ({"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 100},
     r"num_speculative_tokens: must be from 1 to 16, got 100"),
    ({"method": "draft_model", "model": "self", "num_speculative_tokens": 3},
     r"speculative_config\.quantization: a 'self' draft is the target's weights quantized"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, r"speculative_config\.model: method draft_model needs"),
    ({"method": "eagle3", "model": "x", "num_speculative_tokens": 3}, r"method: 'eagle3' is not run by raydecode"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     r"unknown field `draft_tensor_parallel_size`"),
    ({"method": "draft_model", "model": "x", "quantization": "fp8", "num_speculative_tokens": 3},
     r"speculative_config\.quantization: 'int4' or 'int8'"),
    ({"method": "draft_model", "model": "self", "quantization": "int4", "quantization_config": {"group_size": 3},
      "num_speculative_tokens": 3}, r"speculative_config\.quantization_config: group_size must be an even"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, r"speculative_config\.model: only for method"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, r"disable_by_batch_size: must be"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, r"speculative_config: Expected `int`, got `str`"),
    ("ngram", r"speculative_config must be a mapping"),
])
def test_hostile_speculative_configs_are_clear_errors(spec, message):
    from cluster.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)


def test_the_ngram_shorthand_and_the_config_do_not_mix():
    from cluster.config import EngineConfig

    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=r"num_spec_tokens \(--spec-tokens\) and speculative_config both"):
        EngineConfig(num_spec_tokens=3, speculative_config=ngram)
    with pytest.raises(ValueError, match="prompt_lookup_min / prompt_lookup_max"):
        EngineConfig(ngram_max=2, speculative_config=ngram)
    with pytest.raises(ValueError, match="a draft model runs in a single-rank worker only"):
        EngineConfig(tensor_parallel_size=2, speculative_config=self_draft()["speculative_config"])
    config = EngineConfig(speculative_config={**ngram, "prompt_lookup_max": 2})
    assert config.spec_tokens == 3 and config.worker_config().speculative.prompt_lookup_max == 2
    assert EngineConfig(num_spec_tokens=2).speculative.method == "ngram"


def test_ngram_through_the_config_drafts_as_the_shorthand(tiny_model_path):
    base = prompts(400, [6, 4], seed=11)
    ps = [b * 6 for b in base]
    outs = []
    for config in ({"num_spec_tokens": 3}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        _, done = run(make_worker(tiny_model_path, **config), ps)
        outs.append({rid: (r.output, r.num_drafts, r.num_accepted) for rid, r in done.items()})
    assert outs[0] == outs[1] and sum(v[1] for v in outs[0].values()) > 0


# -- through the engine ------------------------------------------------------------------


def test_the_engine_with_drafts_under_prefix_caching_n_and_preemption(ray_local, tiny_model_path, random_draft):
    """Through ``LLM``: shared prompt prefixes (the prefix cache), n = 2, and a KV pool
    small enough to preempt; a draft with its own KV (recomputing what the target found
    cached) and the self draft on the target's KV give the target's greedy tokens, and
    seeded samples equal with either draft across two runs."""
    from cluster import LLM

    base = prompts(400, [40], seed=31)[0]
    ps = [base + tail for tail in prompts(400, [3, 9, 14, 5], seed=32)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, n=2)
    common = dict(num_workers=1, max_num_seqs=4, max_model_len=256, kv_cache_tokens=192, max_num_batched_tokens=48,
                  worker_num_cpus=1)

    cached = []

    def answers(llm, params):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
        cached.append(sum(o.num_cached_tokens for o in outs))
        return [[c.token_ids for c in out.outputs] for out in outs]

    plain = LLM(tiny_model_path, **common)
    try:
        expected = answers(plain, greedy)
    finally:
        plain.shutdown()
    for config in (draft_config(random_draft, 3), self_draft("int8", 3)):
        llm = LLM(tiny_model_path, **config, **common)
        try:
            assert answers(llm, greedy) == expected
            assert answers(llm, seeded) == answers(llm, seeded)
            snap = llm.engine.metrics.snapshot()
            assert snap.spec_decode_num_draft_tokens > 0 and snap.num_preemptions > 0
            assert cached[-1] > 0  # the shared prefix came from the cache
        finally:
            llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "qwen3_moe", "gpt_oss"])
def test_the_families_draft_for_themselves(tmp_path_factory, arch):
    """Qwen3, Gemma 3 (the fused decoder), Qwen3-MoE (its experts quantized in the draft)
    and gpt-oss (sinks, the generic path) as targets of their own int8 copy: most drafts
    hold, and the outputs are the target's alone, prompts past the sliding window."""
    path = str(build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch))
    ps = prompts(400, [6, 30, 12], seed=7)
    _, plain = run(make_worker(path), ps)
    _, spec = run(make_worker(path, **self_draft("int8")), ps)
    drafted = sum(r.num_drafts for r in spec.values())
    assert sum(r.num_accepted for r in spec.values()) > drafted // 3 > 0
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    for i, p in enumerate(ps):
        assert_greedy_equal(reference, p, spec[f"r{i}"].output, plain[f"r{i}"].output)
