"""The CPU paged-attention kernel against the torch reference path (gather the blocks,
then SDPA or the written-out soft-capped math) on random pools and block tables:
queries per row 1-6 (decodes and speculative verification), ragged lengths that end
mid-block, contexts deep enough to span several of the kernel's 256-position tiles (and
windows that straddle them), grouped query heads, sliding windows, soft-capping, float32 and bfloat16.
Then the whole model: greedy output with the kernel equals the torch path's."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_budget import examples
from worker.cpu.kernels import load
from worker.cpu.paged_attention import CpuPagedKernel
from worker.runner.attention import _batched_by_gathering, attend_cached
from worker.runner.attention_plan import AttentionPlan
from worker.runner.kv_pool import PagedKVCache

pytestmark = pytest.mark.skipif(load() is None, reason="no C++ compiler: the kernel cannot be built here")
#: the instruction sets the prefill (lanes) path can take on this CPU: each is tested
ISAS = load().tiled_isas() if load() is not None else []


@contextmanager
def tiled_isa(name: str):
    load().set_tiled_isa(name)
    try:
        yield
    finally:
        load().set_tiled_isa("")


def case(seed: int, rows: int, kv_heads: int, group: int, dim: int, block: int, dtype: torch.dtype,
         depth: int = 70, max_query: int = 6):
    rng = np.random.default_rng(seed)
    q_lens = rng.integers(1, max_query + 1, rows)
    kv_lens = q_lens + rng.integers(0, depth, rows)
    num_blocks = int(sum(-(-k // block) for k in kv_lens)) + 3
    cache = PagedKVCache(1, num_blocks, block, kv_heads, dim, dtype, torch.device("cpu"))
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=torch.Generator().manual_seed(seed)))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=torch.Generator().manual_seed(seed + 1)))
    order = rng.permutation(num_blocks)  # tables are never contiguous
    table = np.zeros((rows, max(-(-k // block) for k in kv_lens) + 1), dtype=np.int32)
    at = 0
    for r, k in enumerate(kv_lens):
        n = -(-int(k) // block)
        table[r, :n] = order[at : at + n]
        at += n
    plan = AttentionPlan.build(cache, np.arange(rows), kv_lens - q_lens, q_lens, table, torch.device("cpu"))
    q = torch.randn(rows * plan.batched_query_len, kv_heads * group, dim, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    return cache, plan, q


def run_kernel(q, cache, plan, scale, softcap, window, sinks=None):
    return CpuPagedKernel(load()).run(q, cache.keys[0], cache.values[0], plan.batched_block_table,
                                      plan.batched_kv_lens, plan.batched_query_lens, scale, softcap, window, sinks)


def random_sinks(draw: bool, heads: int, seed: int) -> torch.Tensor | None:
    """gpt-oss's per-head sinks (None: none), of the scores' own size."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed + 5)) * 2 if draw else None


@settings(max_examples=examples(60), deadline=None)
@given(
    seed=st.integers(0, 2**16), rows=st.integers(1, 9), kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4]), dim=st.sampled_from([16, 22, 64]), block=st.sampled_from([4, 16]),
    window=st.sampled_from([None, 1, 5, 24, 300]), softcap=st.sampled_from([None, 5.0]),
    depth=st.sampled_from([70, 700]), max_query=st.sampled_from([6, 16]), sinks=st.booleans(),
)
@pytest.mark.parametrize("isa", ISAS)
def test_the_kernel_equals_the_torch_path(isa, seed, rows, kv_heads, group, dim, block, window, softcap, depth,
                                          max_query, sinks):
    """Single decodes and short query runs (the per-query path) and rows of 16 or more
    query lanes per KV head (the lanes path, on each instruction set: lane counts not a
    multiple of 8 or 16, head dims not a multiple of 4, windows that hide whole tiles
    from some lanes), with and without attention sinks."""
    cache, plan, q = case(seed, rows, kv_heads, group, dim, block, torch.float32, depth, max_query)
    scale = dim ** -0.5
    sink = random_sinks(sinks, kv_heads * group, seed)
    want = _batched_by_gathering(q, cache.keys[0], cache.values[0], plan, scale, softcap, window, sink)
    with tiled_isa(isa):
        got = run_kernel(q, cache, plan, scale, softcap, window, sink)
    valid = plan.batched_valid
    assert torch.allclose(got[valid], want[valid].float(), atol=2e-5, rtol=1e-4), (got[valid] - want[valid]).abs().max()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("max_query", [6, 16])
@pytest.mark.parametrize("dim,block", [(64, 16), (48, 16), (64, 5)])
def test_bfloat16_pools(isa, max_query, dim, block):
    """bf16 pools on each instruction set; on AVX512-BF16 the prefill runs multiply bf16
    pairs where the head dim is a multiple of 32 and the block size even, and take the
    AVX-512 float way otherwise."""
    cache, plan, q = case(3, 6, 2, 3, dim, block, torch.bfloat16, depth=600, max_query=max_query)
    want = _batched_by_gathering(q.float(), cache.keys[0].float(), cache.values[0].float(), plan, 0.125, None, None)
    with tiled_isa(isa):
        got = run_kernel(q, cache, plan, 0.125, None, None)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got[plan.batched_valid].float(), want[plan.batched_valid], atol=2e-2, rtol=2e-2)


@settings(max_examples=examples(30), deadline=None)
@given(
    seed=st.integers(0, 2**16), chunks=st.lists(st.tuples(st.integers(17, 300), st.integers(0, 400)), min_size=1, max_size=3),
    decodes=st.integers(0, 3), group=st.sampled_from([1, 3]), block=st.sampled_from([4, 16]),
    window=st.sampled_from([None, 7, 200]), softcap=st.sampled_from([None, 5.0]), queries=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), sinks=st.booleans(),
)
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_chunks_as_kernel_rows_equal_the_chunk_path(isa, seed, chunks, decodes, group, block, window, softcap,
                                                            queries, dtype, sinks):
    """A step with prefill chunks (fresh, and after cached tokens; longer and shorter
    than a kernel row) beside decodes: ``attend_cached`` with the chunks cut into
    kernel rows and the decodes beside them, all read in place from a column view of
    a merged q/k/v projection (tokens further apart than their heads), against the
    torch path (gather + SDPA per chunk), windows, softcap and sinks included."""
    rng = np.random.default_rng(seed)
    kv_heads, dim = 2, 32
    n_tok = np.array([n for n, _ in chunks] + [1] * decodes)
    computed = np.array([c for _, c in chunks] + list(rng.integers(1, 300, decodes)))
    rows = len(n_tok)
    need = -(-(computed + n_tok) // block)
    num_blocks = int(need.sum()) + 2
    cache = PagedKVCache(1, num_blocks, block, kv_heads, dim, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=g))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=g))
    order = rng.permutation(num_blocks)
    table = np.zeros((rows, int(need.max()) + 1), dtype=np.int32)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = order[at : at + n]
        at += n
    heads = kv_heads * group
    qkv = torch.randn(int(n_tok.sum()), (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q = qkv[:, : heads * dim].view(-1, heads, dim)  # the fused decoder's layout
    assert not q.is_contiguous()
    kernel = CpuPagedKernel(load(), prefill_queries=queries)
    plan = AttentionPlan.build(cache, np.arange(rows), computed, n_tok, table, torch.device("cpu"), kernel)
    assert plan.kernel_state is not None
    sink = random_sinks(sinks, heads, seed)
    with tiled_isa(isa):
        got = attend_cached(q, plan, 0, dim ** -0.5, window, softcap, sink)
    # the reference runs in float32 on the same values: a bf16 torch path rounds its
    # own intermediates and is no more exact than the kernel it would judge
    exact = PagedKVCache(1, num_blocks, block, kv_heads, dim, torch.float32, torch.device("cpu"))
    exact.keys[0].copy_(cache.keys[0].float())
    exact.values[0].copy_(cache.values[0].float())
    plan = AttentionPlan.build(exact, np.arange(rows), computed, n_tok, table, torch.device("cpu"))
    assert plan.kernel_state is None
    want = attend_cached(q.float(), plan, 0, dim ** -0.5, window, softcap, sink)
    assert got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (2**-8 relative)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_greedy_output_with_the_kernel_equals_the_torch_path(tiny_model_path):
    from helpers import make_worker, prompts
    from sampler.params import SamplingParams
    from worker_driver import MiniDriver

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    results = []
    for kernel in (True, False):
        w = make_worker(tiny_model_path, num_spec_tokens=2, cpu_attention_kernel=kernel)
        assert (w._runner.backend.attention_kernel is not None) == kernel
        d = MiniDriver(w.step, max_rows=4, token_budget=48, chunk=16)
        for i, p in enumerate(prompts(400, [3, 40, 17, 90, 5, 60], seed=5)):
            d.submit(f"r{i}", p, greedy, arrival_step=i)
        done = d.run()
        results.append({rid: (r.output, [v for _, vals, _ in r.logprobs for v in vals]) for rid, r in done.items()})
    with_kernel, torch_path = results
    for rid in torch_path:
        assert with_kernel[rid][0] == torch_path[rid][0]
        assert with_kernel[rid][1] == pytest.approx(torch_path[rid][1], abs=1e-4)


def test_the_packed_call_refuses_rows_outside_the_tokens():
    """A kernel row that names tokens past the packed queries, or keys past its block
    table, is refused before anything is read (it would read and write out of bounds)."""
    cache = PagedKVCache(1, 4, 16, 2, 32, torch.float32, torch.device("cpu"))
    q = torch.randn(10, 4, 32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    kernel = CpuPagedKernel(load())
    for start, q_len, kv_len in ((5, 6, 20), (-1, 2, 2), (0, 4, 3), (0, 4, 33)):
        with pytest.raises(RuntimeError, match="does not fit"):
            kernel.run_packed(q, cache.keys[0], cache.values[0], table, torch.tensor([kv_len], dtype=torch.int32),
                              torch.tensor([q_len], dtype=torch.int32), torch.tensor([start], dtype=torch.int32),
                              0.1, None, None)


@pytest.mark.parametrize("items,threads", [(0, 2), (1, 2), (7, 3), (40, 2), (40, 1)])
def test_the_stealing_split_takes_every_item_once(items, threads):
    """The kernels' work split (worker/cpu/csrc/work_split.h): every item is taken
    exactly once (the C++ side counts double takes and raises), whatever the thread
    count."""
    takers = load().stealing_split_takers(items, threads, -1, 0)
    assert len(takers) == items
    assert all(0 <= t < max(1, min(threads, items)) for t in takers)


def test_a_thread_done_early_takes_a_slow_threads_items_from_the_back():
    """When the thread of one run is held up (preempted, in a Ray actor), the other takes
    what it has not started, from the back of its run; a static split would wait for it."""
    items = 40
    takers = load().stealing_split_takers(items, 2, 0, 2000)  # run 0 ([0, 20)) sleeps 2 ms per item
    if torch.get_num_threads() < 2:  # one thread: it goes through run 0, then takes all of run 1
        assert takers == [0] * items
        return
    assert takers[20:] == [1] * 20  # run 1's own items
    stolen = [i for i in range(20) if takers[i] == 1]
    assert len(stolen) >= 5, takers
    # What was taken over is the back of run 0: a suffix of it.
    assert stolen == list(range(20 - len(stolen), 20))


def test_the_torch_path_takes_sdpa_outputs_in_any_layout(monkeypatch):
    """CUDA's SDPA kernels return their output strided as ``[B, L, H, D]`` seen through
    ``[B, H, L, D]``, where the CPU's is contiguous: the torch path must give the same
    result either way (a ``view`` of that output failed on an H200 for a prefill chunk
    after a cached prefix)."""
    import torch.nn.functional as F

    from helpers import random_paged_case
    from worker.runner import attention

    cache, rows, cached, lens, table, q = random_paged_case(3, [1, 3, 40, 1], 50, 2, 4, 32, 16, torch.float32, 1)
    plan = AttentionPlan.build(cache, rows, cached, lens, table, torch.device("cpu"))
    want = attend_cached(q, plan, 0, 0.125, None, None)
    sdpa = F.scaled_dot_product_attention

    def strided_like_cuda(*args, **kwargs):
        o = sdpa(*args, **kwargs)
        return o.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", strided_like_cuda)
    got = attend_cached(q, AttentionPlan.build(cache, rows, cached, lens, table, torch.device("cpu")), 0, 0.125,
                        None, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 2**16), cached=st.integers(0, 60), n=st.integers(1, 40), block=st.sampled_from([4, 16]),
       window=st.sampled_from([None, 5, 24]), kernel=st.booleans())
def test_attention_sinks_equal_transformers_gpt_oss(seed, cached, n, block, window, kernel):
    """Sinks against transformers' own gpt-oss attention (its eager function, on the
    row's whole keys and values with an additive causal/window mask): a chunk of ``n``
    queries after ``cached`` tokens, blocks shuffled, on the torch path and the kernel."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    kv_heads, group, dim = 2, 3, 16
    heads = kv_heads * group
    g = torch.Generator().manual_seed(seed)
    total = cached + n
    k = torch.randn(1, kv_heads, total, dim, generator=g)
    v = torch.randn(1, kv_heads, total, dim, generator=g)
    q = torch.randn(1, heads, n, dim, generator=g)
    sinks = torch.randn(heads, generator=g) * 2
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, group, False
    pos = torch.arange(cached, total).unsqueeze(1)
    keys = torch.arange(total)
    seen = (keys <= pos) & ((keys > pos - window) if window else True)
    mask = torch.zeros(n, total).masked_fill(~seen, float("-inf"))
    want, _ = eager_attention_forward(module, q, k, v, mask.view(1, 1, n, total), dim ** -0.5)

    need = -(-total // block)
    cache = PagedKVCache(1, need + 3, block, kv_heads, dim, torch.float32, torch.device("cpu"))
    table = np.random.default_rng(seed).permutation(need + 3)[: need + 1].astype(np.int32).reshape(1, -1)
    for p in range(total):
        cache.keys[0][table[0, p // block], :, p % block] = k[0, :, p]
        cache.values[0][table[0, p // block], :, p % block] = v[0, :, p]
    plan = AttentionPlan.build(cache, np.array([0]), np.array([cached]), np.array([n]), table, torch.device("cpu"),
                               CpuPagedKernel(load()) if kernel else None)
    got = attend_cached(q[0].transpose(0, 1).contiguous(), plan, 0, dim ** -0.5, window, None, sinks)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=2e-5)
