"""The engine's monitoring counters (``cluster/metrics.py``) against what the requests
themselves report, on a real engine with speculative decoding and a KV budget small
enough to preempt; and their Prometheus exposition (``deploy/metrics.py``)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    EngineMetrics,
    Histogram,
    request_tokens_buckets,
)
from deploy.metrics import metrics_registry
from sampler.params import SamplingParams


def test_histogram_buckets_are_prometheus_le_buckets():
    h = Histogram((0.1, 1.0, 10.0))
    for value in (0.05, 0.1, 0.5, 1.0, 20.0):
        h.observe(value)
    assert h.cumulative() == [2, 4, 4, 5]  # a value equal to a bound counts in that bucket
    assert h.count == 5 and h.sum == pytest.approx(21.65)
    assert request_tokens_buckets(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert request_tokens_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    # vLLM's own bounds (vllm/v1/metrics/buckets.py): the ends and the sizes
    assert (TIME_TO_FIRST_TOKEN_BUCKETS[0], TIME_TO_FIRST_TOKEN_BUCKETS[-1], len(TIME_TO_FIRST_TOKEN_BUCKETS)) == (0.001, 2560.0, 22)
    assert (INTER_TOKEN_LATENCY_BUCKETS[0], INTER_TOKEN_LATENCY_BUCKETS[-1], len(INTER_TOKEN_LATENCY_BUCKETS)) == (0.01, 80.0, 19)
    assert (REQUEST_LATENCY_BUCKETS[0], REQUEST_LATENCY_BUCKETS[-1], len(REQUEST_LATENCY_BUCKETS)) == (0.3, 7680.0, 21)
    assert EngineMetrics(64).snapshot().request_success == {r: 0 for r in ("stop", "length", "abort", "error", "repetition")}


@pytest.fixture(scope="module")
def llm(ray_local, tiny_model_path):
    from cluster import LLM

    # 4 blocks of 16 tokens: two growing requests cannot both fit, so the newest is preempted.
    llm = LLM(tiny_model_path, max_model_len=128, max_num_seqs=4, kv_cache_tokens=64, kv_block_size=16,
              num_spec_tokens=2, worker_num_cpus=1)
    yield llm
    llm.shutdown()


def test_counters_match_the_requests(llm):
    engine = llm.engine
    prompts = ["the fox the fox the fox the fox", "a stitch a stitch a stitch", "ray ray ray ray ray",
               "tokens flow tokens flow", "the quick brown fox jumps"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4 + \
             [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2)]
    before = engine.metrics.snapshot()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    snap = engine.metrics.snapshot()

    def grew(name: str) -> int:
        return getattr(snap, name) - getattr(before, name)

    samples = [c for o in outputs for c in o.outputs]
    assert grew("generation_tokens") == sum(len(c.token_ids) for c in samples)
    assert grew("prompt_tokens") == sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs)
    assert snap.request_success["length"] - before.request_success["length"] == len(samples) == 6
    preempted = sum(o.metrics.num_preemptions for o in outputs)
    assert preempted > 0 and grew("num_preemptions") == preempted
    drafts, proposed, accepted = (grew(n) for n in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                    "spec_decode_num_accepted_tokens"))
    assert 0 < drafts <= proposed <= 2 * drafts and 0 <= accepted <= proposed
    h = {k: v.count - before.histograms[k].count for k, v in snap.histograms.items()}
    assert h["e2e_request_latency_seconds"] == h["time_to_first_token_seconds"] == len(outputs)
    assert h["request_prompt_tokens"] == h["request_generation_tokens"] == len(samples)
    assert snap.histograms["request_generation_tokens"].sum - before.histograms["request_generation_tokens"].sum \
        == sum(len(c.token_ids) for c in samples)
    stats = engine.scheduler_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_exposition_has_spec_decode_counters_when_it_is_on(llm):
    text = generate_latest(metrics_registry(llm.engine, "tiny")).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    snap = llm.engine.metrics.snapshot()
    for name, value in (("vllm:spec_decode_num_drafts", snap.spec_decode_num_drafts),
                        ("vllm:spec_decode_num_draft_tokens", snap.spec_decode_num_draft_tokens),
                        ("vllm:spec_decode_num_accepted_tokens", snap.spec_decode_num_accepted_tokens),
                        ("vllm:num_preemptions", snap.num_preemptions)):
        (sample,) = families[name].samples
        assert families[name].type == "counter" and sample.name == name + "_total"
        assert sample.labels == {"model_name": "tiny", "engine": "0"} and sample.value == value
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples}
    assert success["length"] == snap.request_success["length"] and set(success) >= {"stop", "abort", "error"}
    e2e = families["vllm:e2e_request_latency_seconds"]
    bounds = [float(s.labels["le"]) for s in e2e.samples if s.name.endswith("_bucket")]
    assert bounds == [*REQUEST_LATENCY_BUCKETS, math.inf]
    tokens = families["vllm:request_prompt_tokens"]
    assert [float(s.labels["le"]) for s in tokens.samples if s.name.endswith("_bucket")][-2:] == [100.0, math.inf]


def prefix_cache_samples(llm) -> tuple[float, float]:
    text = generate_latest(metrics_registry(llm.engine, "tiny")).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (queries,) = families["vllm:prefix_cache_queries"].samples
    (hits,) = families["vllm:prefix_cache_hits"].samples
    assert queries.name == "vllm:prefix_cache_queries_total"
    worker = str(llm.engine.workers[0].index)  # one prefix cache per worker
    assert queries.labels == hits.labels == {"model_name": "tiny", "engine": "0", "worker": worker}
    return queries.value, hits.value


def test_exposition_counts_prefix_cache_queries_and_hits(llm):
    prompt = {"prompt_token_ids": list(range(40, 80))}  # 40 tokens: two full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    queries0, hits0 = prefix_cache_samples(llm)
    llm.generate([prompt], params, use_tqdm=False)
    llm.generate([prompt], params, use_tqdm=False)  # the second finds the first's full blocks
    queries, hits = prefix_cache_samples(llm)
    assert queries - queries0 >= 2 * 40 - 1 and hits - hits0 == 32
    (worker,) = llm.engine.prefix_cache_stats()
    assert (worker["queries"], worker["hits"]) == (queries, hits)
