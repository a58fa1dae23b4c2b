"""Paged attention through FlexAttention (``worker/gpu/flex_attention.py``, the path
CUDA workers take) against the torch reference path (gather each row's blocks, then
SDPA or the written-out soft-capped math), on CPU: eager on random small pools (decodes,
speculative query runs, prefill chunks continuing a cached prefix, rows sharing prefix
blocks, grouped query heads, soft-capping, float32 and bfloat16), one compiled case, and
the whole model's greedy output with the path on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import random_paged_case
from hypothesis_budget import examples
from worker.gpu.flex_attention import FlexPagedAttention
from worker.runner.attention import attend_cached
from worker.runner.attention_plan import AttentionPlan
from worker.runner.kv_pool import PagedKVCache

# Eager FlexAttention warns that it is unfused; here that is the point (an exact path).
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def both_ways(cache, rows, cached, q_lens, table, q, heads, kv_heads, softcap=None, compiled=False, window=None,
              sinks=None):
    flex = FlexPagedAttention(heads, kv_heads, compiled=compiled)
    flex.windows.add(window)  # as the load's probe would have found it
    plan = AttentionPlan.build(cache, rows, cached, q_lens, table, torch.device("cpu"), flex)
    assert plan.kernel_state is not None
    scale = q.shape[-1] ** -0.5
    got = attend_cached(q, plan, 0, scale, window, softcap, sinks)
    assert flex.declined == 0
    reference = AttentionPlan.build(cache, rows, cached, q_lens, table, torch.device("cpu"))
    want = attend_cached(q, reference, 0, scale, window, softcap, sinks)
    return got, want


@settings(max_examples=examples(25), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    q_lens=st.lists(st.sampled_from([1, 1, 1, 2, 5, 16, 17, 40, 90]), min_size=1, max_size=6),
    depth=st.sampled_from([0, 9, 70]), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3, 4]),
    dim=st.sampled_from([16, 32]), block=st.sampled_from([8, 16]), softcap=st.sampled_from([None, 5.0]),
    shared=st.sampled_from([0, 2]), window=st.sampled_from([None, None, 5, 24]), sinks=st.booleans(),
)
def test_flex_equals_the_torch_path(seed, q_lens, depth, kv_heads, group, dim, block, softcap, shared, window, sinks):
    """With and without attention sinks (gpt-oss: applied to FlexAttention's output
    through its log-sum-exp)."""
    cache, rows, cached, lens, table, q = random_paged_case(seed, q_lens, depth, kv_heads, group, dim, block,
                                                            torch.float32, shared)
    sink = torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(seed)) * 2 if sinks else None
    got, want = both_ways(cache, rows, cached, lens, table, q, kv_heads * group, kv_heads, softcap, window=window,
                          sinks=sink)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_flex_in_bfloat16_equals_the_float32_reference():
    """bf16 pools: flex computes in the pool's dtype; the float32 torch path over the
    same values is the judge (a bf16 torch path rounds its own intermediates)."""
    cache, rows, cached, lens, table, q = random_paged_case(3, [1, 4, 33], 40, 2, 2, 32, 16, torch.bfloat16, 1)
    got, _ = both_ways(cache, rows, cached, lens, table, q, 4, 2)
    exact = PagedKVCache(1, cache.num_blocks, cache.block_size, 2, 32, torch.float32, torch.device("cpu"))
    exact.keys[0].copy_(cache.keys[0].float())
    exact.values[0].copy_(cache.values[0].float())
    plan = AttentionPlan.build(exact, rows, cached, lens, table, torch.device("cpu"))
    want = attend_cached(q.float(), plan, 0, 32 ** -0.5, None, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@settings(max_examples=examples(30), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    q_lens=st.lists(st.sampled_from([1, 1, 2, 5, 16, 17, 40, 90]), min_size=1, max_size=4),
    depth=st.sampled_from([0, 9, 70]), group=st.sampled_from([1, 3, 4]), block=st.sampled_from([8, 16]),
    window=st.sampled_from([None, 1, 5, 16, 24, 33, 200]), static=st.booleans(), shared=st.sampled_from([0, 2]),
)
def test_block_lists_hold_every_key_the_mask_sees_and_full_tiles_only_seen_keys(
        seed, q_lens, depth, group, block, window, static, shared):
    """Eager FlexAttention applies the mask function everywhere; the compiled kernel
    reads only the listed tiles, and skips the mask on tiles listed full. So, for every
    call of a step, with and without a sliding window: the listed tiles are exactly those
    holding a key the mask function lets some query see, and the full ones exactly those
    whose every key every query of the query tile sees (the padding queries past a
    row's length aside)."""
    from torch.nn.attention.flex_attention import create_mask

    kv_heads = 2
    cache, rows, cached, lens, table, _ = random_paged_case(seed, q_lens, depth, kv_heads, group, 16, block,
                                                            torch.float32, shared)
    flex = FlexPagedAttention(kv_heads * group, kv_heads)
    flex.windows.add(window)
    plan = AttentionPlan.build(cache, rows, cached, lens, table, torch.device("cpu"), flex, static=static)
    calls = [c for c in plan.kernel_state.calls if c.window == window]
    assert calls
    for call in calls:
        m = call.block_mask
        q_tile, kv_tile = m.BLOCK_SIZE
        b, heads, q_len, kv_len = call.index.shape[0], kv_heads, m.seq_lengths[0], m.seq_lengths[1]
        seen = create_mask(m.mask_mod, b, heads, q_len, kv_len, device="cpu")
        folded = call.mask_inputs[2]
        for r in range(b):
            for h in range(heads):
                for t in range(-(-q_len // q_tile)):
                    partial = set(m.kv_indices[r, h, t, : m.kv_num_blocks[r, h, t]].tolist())
                    full = set(m.full_kv_indices[r, h, t, : m.full_kv_num_blocks[r, h, t]].tolist())
                    assert not partial & full
                    rows_q = slice(t * q_tile, min((t + 1) * q_tile, q_len))
                    live = max(min(rows_q.stop, int(folded[r])) - rows_q.start, 0)
                    tiles_seen = seen[r, h, rows_q].reshape(-1, kv_len // kv_tile, kv_tile)
                    any_seen = set(tiles_seen.any(dim=(0, 2)).nonzero().flatten().tolist())
                    whole = set(tiles_seen[:live].all(dim=(0, 2)).nonzero().flatten().tolist()) if live else set()
                    assert partial | full == any_seen, f"row {r} head {h} tile {t}: listed {partial | full}, seen {any_seen}"
                    assert full == whole, f"row {r} head {h} tile {t}: listed full {full}, seen whole {whole}"


@pytest.mark.parametrize("bs", [4, 16])
def test_window_block_lists_at_every_offset(bs):
    """A sweep the property test samples: one row at every start position over three
    blocks, every window from 1 to two blocks and one, short and long queries; the lists
    against positions counted by hand (key j seen by query p when p - window < j <= p)."""
    group, kv_heads = 2, 1
    for window in range(1, 2 * bs + 2):
        flex = FlexPagedAttention(group * kv_heads, kv_heads)
        flex.windows = {window}
        for q_start in range(3 * bs):
            for q_len in (1, 3, 20):
                kv_len = q_start + q_len
                nblocks = -(-kv_len // bs)
                cache = PagedKVCache(1, nblocks + 1, bs, kv_heads, 8, torch.float32, torch.device("cpu"))
                table = np.arange(nblocks, dtype=np.int32)[None, :]  # logical block = physical block
                plan = AttentionPlan.build(cache, np.array([0]), np.array([q_start]), np.array([q_len]), table,
                                           torch.device("cpu"), flex)
                (call,) = plan.kernel_state.calls
                m = call.block_mask
                q_tile = m.BLOCK_SIZE[0]
                for t in range(-(-q_len * group // q_tile)):
                    positions = [q_start + i // group for i in range(t * q_tile, min((t + 1) * q_tile, q_len * group))]
                    sees = [{j for j in range(max(p - window + 1, 0), p + 1)} for p in positions]
                    listed = {j // bs for keys in sees for j in keys}
                    whole = {b for b in listed if all(set(range(b * bs, (b + 1) * bs)) <= keys for keys in sees)}
                    partial = set(m.kv_indices[0, 0, t, : m.kv_num_blocks[0, 0, t]].tolist())
                    full = set(m.full_kv_indices[0, 0, t, : m.full_kv_num_blocks[0, 0, t]].tolist())
                    where = f"window {window}, start {q_start}, {q_len} queries, tile {t}"
                    assert partial | full == listed and not partial & full, where
                    assert full == whole, where


def test_a_block_at_two_positions_hands_the_step_to_the_torch_path():
    """The mask reads one logical position per physical block; a table that breaks that
    (never made by the block manager) must not be attended wrongly."""
    cache, rows, cached, lens, table, q = random_paged_case(5, [1, 1], 40, 1, 2, 16, 8, torch.float32, 0)
    table[1, 0], table[1, 1] = table[0, 1], table[0, 0]  # row 1 holds row 0's blocks swapped
    flex = FlexPagedAttention(2, 1)
    plan = AttentionPlan.build(cache, rows, cached, lens, table, torch.device("cpu"), flex)
    assert plan.kernel_state is None
    got = attend_cached(q, plan, 0, 0.25, None, None)
    want = attend_cached(q, AttentionPlan.build(cache, rows, cached, lens, table, torch.device("cpu")), 0, 0.25, None, None)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window", [None, 20])
def test_compiled_flex_equals_the_torch_path(window):
    """Compiled (inductor's CPU template here; Triton on CUDA), which reads only the
    listed tiles: decodes, a draft run and a prefill chunk over a shared prefix, grouped
    heads, with and without a sliding window."""
    cache, rows, cached, lens, table, q = random_paged_case(11, [1, 3, 1, 40], 50, 2, 3, 32, 16, torch.float32, 2)
    got, want = both_ways(cache, rows, cached, lens, table, q, 6, 2, compiled=True, window=window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_output_with_flex_equals_the_cpu_kernel(tiny_model_path):
    """The whole model on CPU with FlexAttention (eager) in place of the CPU kernel:
    the same greedy tokens, logprobs within float32 rounding (chunked prefill, prefix
    sharing across n, speculative drafts)."""
    with_flex = greedy_run(tiny_model_path, flex_attention=True)
    default = greedy_run(tiny_model_path)
    assert with_flex.keys() == default.keys()
    for rid in default:
        assert with_flex[rid][0] == default[rid][0], rid
        assert with_flex[rid][1] == pytest.approx(default[rid][1], abs=1e-4)


def greedy_run(path: str, before=None, **config) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy tokens and logprobs of a fixed mix of requests; ``before(worker)`` runs
    ahead of the first step."""
    from helpers import make_worker, prompts
    from sampler.params import SamplingParams
    from worker_driver import MiniDriver

    config.setdefault("num_spec_tokens", 0 if config.get("cuda_graphs") else 2)
    w = make_worker(path, **config)
    if before is not None:
        before(w)
    assert isinstance(w._runner.backend.attention_kernel, FlexPagedAttention) == bool(config.get("flex_attention"))
    assert (w._runner.graphs is not None) == bool(config.get("cuda_graphs"))
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    d = MiniDriver(w.step, max_rows=4, token_budget=48, chunk=16)
    shared = prompts(400, [40], seed=9)[0]
    for i, p in enumerate(prompts(400, [3, 40, 17, 5], seed=5) + [shared + [7, 8], shared + [9]]):
        d.submit(f"r{i}", p, greedy, arrival_step=i)
    done = d.run()
    return {rid: (r.output, [v for _, vals, _ in r.logprobs for v in vals]) for rid, r in done.items()}


def test_decode_graph_inputs_are_refilled_for_every_step(tiny_model_path):
    """``cuda_graphs`` replays a decode step on fixed inputs refilled each step. Off CUDA
    the refilled inputs run eagerly: anything the refill missed would show here as a
    different token or logprob than the plain FlexAttention path (rows joining and
    leaving, buckets 1-4, padding rows)."""
    graphs = greedy_run(tiny_model_path, flex_attention=True, cuda_graphs=True, cpu_fused_decoder=False)
    plain = greedy_run(tiny_model_path, flex_attention=True, cpu_fused_decoder=False)
    for rid in plain:
        assert graphs[rid][0] == plain[rid][0], rid
        assert graphs[rid][1] == pytest.approx(plain[rid][1], abs=1e-5)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_graphs_replay_a_model_with_a_sliding_window(tmp_path, caplog, arch):
    """Sliding-window layers attend through FlexAttention too (the window in the mask
    function and in the block lists; the load's probe finds it), so the graphs replay
    their decode steps: the tokens and logprobs are the CPU kernel's (Mistral: every
    layer windowed; Gemma 2: windowed and global layers, soft-capped logits)."""
    import logging

    from tiny_model import build_tiny_model

    path = str(build_tiny_model(tmp_path / arch, arch=arch))
    settled = []
    with caplog.at_level(logging.WARNING, logger="worker.gpu.cuda_graphs"):
        graphs = greedy_run(path, before=lambda w: settled.append(set(w._runner.backend.attention_kernel.windows)),
                            flex_attention=True, cuda_graphs=True, cpu_fused_decoder=False)
    assert "CUDA graphs are off" not in caplog.text
    # the load's probe found the layers' windows, and only those are prepared
    assert settled == [{24} if arch == "mistral" else {None, 24}]
    kernel = greedy_run(path)
    for rid in kernel:
        assert graphs[rid][0] == kernel[rid][0], rid
        assert graphs[rid][1] == pytest.approx(kernel[rid][1], abs=1e-4)


def test_graphs_are_captured_again_when_a_window_is_learned_after_them(tiny_model_path):
    """A window the kernel learns after a capture adds calls (and inputs) the graphs do
    not hold: they are dropped and captured again, the tokens unchanged."""
    snapshots = []

    def learn_late(w):
        graphs = w._runner.graphs
        run = graphs.run

        def run_and_learn(*args):
            if len(snapshots) == 6:
                graphs.kernel.windows.add(1000)
            out = run(*args)
            snapshots.append({g.windows for g in graphs.graphs.values()})
            return out

        graphs.run = run_and_learn

    late = greedy_run(tiny_model_path, before=learn_late, flex_attention=True, cuda_graphs=True,
                      cpu_fused_decoder=False)
    assert snapshots[0] == {frozenset({None})} and snapshots[-1] == {frozenset({None, 1000})}
    plain = greedy_run(tiny_model_path, flex_attention=True, cuda_graphs=True, cpu_fused_decoder=False)
    for rid in plain:
        assert late[rid][0] == plain[rid][0], rid
        assert late[rid][1] == pytest.approx(plain[rid][1], abs=1e-5)


def test_graphs_turn_themselves_off_when_a_layer_takes_the_torch_path(tmp_path, caplog):
    """A layer whose attention takes the torch path builds its inputs on the host for
    each step: a graph would replay the capture's. Made to happen here by a kernel that
    forgets the window the probe found and never learns it again: the graphs see the
    torch path taken in their warm-up and leave every decode step to the eager forward,
    whose tokens are the CPU kernel's."""
    import logging

    from tiny_model import build_tiny_model

    class NeverLearns(set):
        def add(self, window):
            pass

    path = str(build_tiny_model(tmp_path / "mistral", arch="mistral"))
    forget = lambda w: setattr(w._runner.backend.attention_kernel, "windows", NeverLearns({None}))  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="worker.gpu.cuda_graphs"):
        graphs = greedy_run(path, before=forget, flex_attention=True, cuda_graphs=True, cpu_fused_decoder=False)
    assert "CUDA graphs are off for this model: some layers' attention takes the torch path" in caplog.text
    kernel = greedy_run(path)
    for rid in kernel:
        assert graphs[rid][0] == kernel[rid][0], rid
        assert graphs[rid][1] == pytest.approx(kernel[rid][1], abs=1e-4)


@pytest.mark.parametrize("q_lens", [[1], [1, 3], [17], [40], [33, 1], [90], [300, 5], [64], [65]])
def test_query_tiles_are_powers_of_two(q_lens):
    """Triton compiles FlexAttention's tiles only in powers of two (a 48-query tile of a
    40-token chunk failed on an H100): every call's query tile is one, at least 16."""
    cache, rows, cached, lens, table, q = random_paged_case(1, q_lens, 20, 1, 2, 16, 16, torch.float32, 0)
    plan = AttentionPlan.build(cache, rows, cached, lens, table, torch.device("cpu"), FlexPagedAttention(2, 1))
    for call in plan.kernel_state.calls:
        q_tile, kv_tile = call.block_mask.BLOCK_SIZE
        assert q_tile >= 16 and q_tile & (q_tile - 1) == 0, q_tile
        assert kv_tile == 16


def test_compiled_norms_give_the_tokens_of_transformers_norms(tiny_model_path):
    """``compiled_norms`` (on with CUDA graphs) gives each RMSNorm a compiled twin that
    the graphs' recorded forward switches on; off CUDA the graphs' refilled inputs run
    eagerly through it. In float32 the tokens and logprobs are those of transformers'
    own norms (rows joining and leaving, buckets 1-4, padding rows)."""
    from helpers import make_worker
    from worker.gpu.compiled_norms import CompiledNorms

    w = make_worker(tiny_model_path, flex_attention=True, cuda_graphs=True, cpu_fused_decoder=False)
    norms = [m for m in w._runner.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all("forward" in m.__dict__ for m in norms)
    switch = w._runner.graphs.recorded.compiled_norms
    assert isinstance(switch, CompiledNorms) and switch.count == len(norms) and not switch.on
    assert w._runner.graphs.forward == w._runner._forward  # the steps the graphs decline: plain norms
    del w
    fused = greedy_run(tiny_model_path, flex_attention=True, cuda_graphs=True, cpu_fused_decoder=False)
    plain = greedy_run(tiny_model_path, flex_attention=True, cuda_graphs=True, compiled_norms=False,
                       cpu_fused_decoder=False)
    for rid in plain:
        assert fused[rid][0] == plain[rid][0], rid
        assert fused[rid][1] == pytest.approx(plain[rid][1], abs=1e-5)


def test_compiled_norms_run_only_inside_the_switch():
    """Each norm runs its class's compiled forward inside ``wrap`` and transformers' own
    outside it, with the same result (float32)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from worker.gpu.compiled_norms import CompiledNorms

    model = torch.nn.Sequential(LlamaRMSNorm(8), torch.nn.Linear(8, 8), LlamaRMSNorm(8))
    model[0].weight.data.uniform_(0.5, 1.5)
    norms = CompiledNorms(model)
    assert norms.count == 2 and list(norms.compiled) == [LlamaRMSNorm]
    compiled, calls = norms.compiled[LlamaRMSNorm], []

    def spy(*args, **kwargs):
        calls.append(args[0])
        return compiled(*args, **kwargs)

    norms.compiled[LlamaRMSNorm] = spy
    x = torch.randn(3, 8)
    plain = model(x)
    assert calls == []
    fused = norms.wrap(model)(x)
    assert calls == [model[0], model[2]] and not norms.on
    torch.testing.assert_close(fused, plain)
    model(x)
    assert len(calls) == 2


def test_latent_attention_with_flex_equals_the_cpu_kernel(tmp_path):
    """Multi-head latent attention through FlexAttention (eager on the CPU; its pool one
    KV head of latent + rotary key, which the backend's FlexAttention must be built
    for): the CPU kernel's greedy tokens, logprobs within float32 rounding (the
    kernel's against transformers: the families sweep; sinks through FlexAttention:
    ``test_flex_equals_the_torch_path``)."""
    from test_model_families import build_family

    path = str(build_family(tmp_path / "deepseek_v3", "deepseek_v3"))
    with_flex = greedy_run(path, flex_attention=True, cpu_fused_decoder=False)
    default = greedy_run(path)
    for rid in default:
        assert with_flex[rid][0] == default[rid][0], rid
        assert with_flex[rid][1] == pytest.approx(default[rid][1], abs=1e-4)
