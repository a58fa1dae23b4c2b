"""Tensor and pipeline parallelism across Ray actors.

The layout arithmetic (pure, property-tested), each rank's shard against the full
checkpoint, and end to end on the tiny model: TP=2 and TP=4 (4 query heads, 2 KV heads:
at TP=4 the KV heads are replicated) and PP=2 (two batches in flight, and bit-identical
with one) against one whole worker, TP x PP x DP
with chunked prefill, preemption, prefix caching, n > 1, logprobs, prompt logprobs, a
stop string and an abort, a rank killed mid-batch, and the refusals. SmolLM2 (9 heads, 3
KV heads, 30 layers) at TP=3 and PP=2, and served at TP=3, are marked ``smollm2``.

Two runs of the same model split differently sum in a different order (the all-reduce),
so greedy tokens may part where the two runs sit on a near-tie: at the first differing
position each run's token is in the other's top 2 with log-probabilities within 1e-3.
Such cases are counted (and must be few); anything else fails. Pipeline parallelism with
one batch in flight changes no arithmetic: it must be bit-identical; with two in flight
(one per stage) the batches have other shapes, and the near-tie rule applies.
"""

from __future__ import annotations

import os
import signal

import pytest
import ray
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster import LLM, RequestOutput
from helpers import assert_greedy_equal, generate, prompts
from hypothesis_budget import examples
from sampler.params import SamplingParams
from tiny_model import build_tiny_model
from worker.cpu.shm_allreduce import ShmAllReduce
from worker.parallel.layout import (
    ModelShape,
    ParallelSizeError,
    check_parallel_sizes,
    layer_partition,
    rank_layout,
    tp_sizes_that_work,
)

VOCAB = 400
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
SMOLLM2 = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                     intermediate_size=1536, vocab_size=49152)
LOGPROB_TOLERANCE = 1e-4  # float32, summation order only


# -- the layout -------------------------------------------------------------------------


@given(layers=st.integers(1, 96), pp=st.integers(1, 96))
def test_layers_split_evenly_leftovers_to_the_earlier_stages(layers, pp):
    if pp > layers:
        with pytest.raises(ParallelSizeError, match="exceeds the model's"):
            layer_partition(layers, pp)
        return
    parts = layer_partition(layers, pp)
    assert sum(parts) == layers and len(parts) == pp
    assert max(parts) - min(parts) <= 1 and parts == sorted(parts, reverse=True)


def test_an_explicit_partition_overrides_and_is_checked():
    assert layer_partition(30, 3, [5, 20, 5]) == [5, 20, 5]
    with pytest.raises(ParallelSizeError, match="3 stages summing to the model's 30 layers"):
        layer_partition(30, 3, [10, 10])


@st.composite
def shapes_and_sizes(draw):
    kv = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = kv * draw(st.integers(1, 6))
    shape = ModelShape(num_layers=draw(st.integers(1, 12)), num_heads=heads, num_kv_heads=kv, head_dim=8,
                       hidden_size=64, intermediate_size=24 * draw(st.integers(1, 4)), vocab_size=draw(st.integers(5, 999)))
    tp = draw(st.sampled_from(tp_sizes_that_work(shape, limit=24)))
    pp = draw(st.integers(1, shape.num_layers))
    return shape, tp, pp


@given(shapes_and_sizes())
@settings(max_examples=examples(200))
def test_every_head_column_layer_and_token_has_exactly_one_owner_per_stage(case):
    shape, tp, pp = case
    layouts = [rank_layout(shape, tp, pp, r) for r in range(tp * pp)]
    assert [lay.rank for lay in layouts] == list(range(tp * pp))
    assert sum(1 for lay in layouts if lay.is_leader) == 1
    for stage in range(pp):
        ranks = [lay for lay in layouts if lay.pp_rank == stage]
        assert len({lay.layers for lay in ranks}) == 1
        for field, size in (("q_heads", shape.num_heads), ("intermediate", shape.intermediate_size),
                            ("vocab", shape.vocab_size)):
            covered = sorted(i for lay in ranks for i in range(*getattr(lay, field)))
            assert covered == list(range(size)), field
        group = shape.num_heads // shape.num_kv_heads
        for lay in ranks:  # a rank holds the KV heads its query heads read
            assert all(lay.kv_heads[0] <= h // group < lay.kv_heads[1] for h in range(*lay.q_heads))
            assert lay.vocab_shard * tp >= shape.vocab_size
    assert [i for lay in layouts if lay.tp_rank == 0 for i in lay.layers] == list(range(shape.num_layers))


def test_smollm2_takes_tp_3_and_is_refused_tp_2_saying_which_sizes_work():
    assert tp_sizes_that_work(SMOLLM2) == [1, 3]
    layout = rank_layout(SMOLLM2, 3, 2, 4)
    assert (layout.q_heads, layout.kv_heads, layout.layers) == ((3, 6), (1, 2), range(15, 30))
    with pytest.raises(ParallelSizeError, match=r"its 9 attention heads do not divide by 2 \(sizes that work: 1, 3\)"):
        check_parallel_sizes(_hf_config(SMOLLM2), 2, 1)
    with pytest.raises(ParallelSizeError, match="pipeline_parallel_size 31 exceeds the model's 30 layers"):
        check_parallel_sizes(_hf_config(SMOLLM2), 1, 31)


def _hf_config(shape: ModelShape):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                       num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size)


# -- a rank's shard ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _shard(path: str, tp: int, pp: int, rank: int):
    from worker.parallel.sharded_loader import load_model_shard

    loaded, layout = load_model_shard(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank,
                                      device="cpu", dtype="float32")
    return loaded.model, layout, loaded


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_shards_put_back_together_are_the_checkpoint(tiny_model_path, full_model, tp):
    shards = [_shard(tiny_model_path, tp, 1, r) for r in range(tp)]
    full = full_model.model.layers[1]
    layers = [m.model.layers[1] for m, _, _ in shards]
    cat = lambda name, dim: torch.cat([eval(f"l.{name}").weight for l in layers], dim=dim)  # noqa: E731
    assert torch.equal(cat("self_attn.q_proj", 0), full.self_attn.q_proj.weight)
    assert torch.equal(cat("self_attn.o_proj", 1), full.self_attn.o_proj.weight)
    assert torch.equal(cat("mlp.gate_proj", 0), full.mlp.gate_proj.weight)
    assert torch.equal(cat("mlp.down_proj", 1), full.mlp.down_proj.weight)
    # 2 KV heads: split at TP=2, each replicated on two ranks at TP=4
    kv = [l.self_attn.k_proj.weight for l in layers]
    if tp == 2:
        assert torch.equal(torch.cat(kv), full.self_attn.k_proj.weight)
    else:
        assert torch.equal(kv[0], kv[1]) and torch.equal(kv[2], kv[3])
        assert torch.equal(torch.cat([kv[0], kv[2]]), full.self_attn.k_proj.weight)
    head = torch.cat([m.lm_head.weight for m, _, _ in shards])
    assert torch.equal(head[:VOCAB], full_model.lm_head.weight) and not head[VOCAB:].any()
    # Resident layer weights: 1/tp of the model's per rank, but for replicated KV heads
    def layer_weights(m):
        return sum(p.numel() for n, p in m.named_parameters() if ".layers." in n and "norm" not in n)

    kv = sum(l.self_attn.k_proj.weight.numel() + l.self_attn.v_proj.weight.numel() for l in full_model.model.layers)
    copies = max(1, tp // full_model.config.num_key_value_heads)  # ranks holding each KV head
    assert sum(layer_weights(m) for m, _, _ in shards) == layer_weights(full_model) + (copies - 1) * kv
    for m, _layout, loaded in shards:
        assert loaded.vocab_size == full_model.config.vocab_size  # the logits gathered, not a slice
        assert m.config.num_attention_heads == 4 // tp and not m.config.tie_word_embeddings


def test_fused_projections_shard_per_part(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj: each rank holds its query heads, its
    key/value heads and its MLP columns of each part, joined in the checkpoint's order."""
    from transformers import AutoModelForCausalLM

    path = str(build_tiny_model(tmp_path / "phi3", arch="phi3"))
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[0]
    shards = [_shard(path, 2, 1, r)[0].model.layers[0] for r in range(2)]
    heads, kv, dim, width = 4, 2, 16, 128
    w = full.self_attn.qkv_proj.weight
    q, k, v = w.split([heads * dim, kv * dim, kv * dim])
    for r, layer in enumerate(shards):
        got = layer.self_attn.qkv_proj.weight
        parts = [t[r * n * dim // 2 : (r + 1) * n * dim // 2] for t, n in ((q, heads), (k, kv), (v, kv))]
        assert torch.equal(got, torch.cat(parts))
        gate, up = full.mlp.gate_up_proj.weight.split([width, width])
        half = width // 2
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate[r * half : (r + 1) * half],
                                                                     up[r * half : (r + 1) * half]]))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_every_expert_shards_per_rank_and_puts_back_together(tmp_path, arch):
    """Every rank holds every expert, cut to its columns: Qwen3-MoE's files keep one
    tensor per expert (stacked by transformers at load: the rank loads the model whole),
    gpt-oss's are stacked ``[experts, in, out]`` with the gate and up columns interleaved
    (read as slices). The router is whole on every rank, the down bias on rank 0 only,
    the sinks split with their query heads."""
    from transformers import AutoModelForCausalLM

    path = str(build_tiny_model(tmp_path / arch, arch=arch))
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[0]
    ranks = [_shard(path, 2, 1, r)[0].model.layers[0] for r in range(2)]
    experts = [layer.mlp.experts for layer in ranks]
    if arch == "gpt_oss":
        gate_up = torch.stack([e.gate_up_proj for e in experts], dim=2)  # [E, in, rank, 2w]
        e, i, _, w2 = gate_up.shape
        assert torch.equal(gate_up.reshape(e, i, 2 * w2), full.mlp.experts.gate_up_proj)
        assert torch.equal(torch.cat([e.down_proj for e in experts], dim=1), full.mlp.experts.down_proj)
        assert torch.equal(experts[0].down_proj_bias, full.mlp.experts.down_proj_bias)
        assert not experts[1].down_proj_bias.any()
        assert torch.equal(torch.cat([l.self_attn.sinks for l in ranks]), full.self_attn.sinks)
        assert all(torch.equal(l.mlp.router.weight, full.mlp.router.weight) for l in ranks)
    else:
        gate, up = full.mlp.experts.gate_up_proj.chunk(2, dim=1)
        halves = [e.gate_up_proj.chunk(2, dim=1) for e in experts]
        assert torch.equal(torch.cat([h[0] for h in halves], dim=1), gate)
        assert torch.equal(torch.cat([h[1] for h in halves], dim=1), up)
        assert torch.equal(torch.cat([e.down_proj for e in experts], dim=2), full.mlp.experts.down_proj)
        assert all(torch.equal(l.mlp.gate.weight, full.mlp.gate.weight) for l in ranks)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_ranks_hold_their_experts_whole(tmp_path, arch):
    """With expert parallelism each rank holds its half of the experts, each whole (the
    biases with them), and the router over all of them."""
    from transformers import AutoModelForCausalLM

    from worker.parallel.sharded_loader import load_model_shard

    path = str(build_tiny_model(tmp_path / arch, arch=arch))
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[0].mlp
    ranks = [load_model_shard(path, tensor_parallel_size=2, pipeline_parallel_size=1, rank=r,
                              enable_expert_parallel=True)[0].model.model.layers[0].mlp for r in range(2)]
    total = full.experts.num_experts
    for r, mlp in enumerate(ranks):
        experts = mlp.experts
        assert (experts.first_expert, experts.num_experts, experts.total_experts) == (r * total // 2, total // 2, total)
        for local in range(total // 2):
            e = r * total // 2 + local
            up = full.experts.gate_up_proj[e]
            up = up.t() if arch == "gpt_oss" else up  # gpt-oss stores [in, out]
            assert torch.equal(experts.expert_up[local].weight, up)
            if arch == "gpt_oss":
                assert torch.equal(experts.expert_down[local].bias, full.experts.down_proj_bias[e])
        router = mlp.router if arch == "gpt_oss" else mlp.gate
        assert torch.equal(router.weight, (full.router if arch == "gpt_oss" else full.gate).weight)


def test_expert_parallelism_that_cannot_work_is_refused_before_anything_starts(ray_local, tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="enable_expert_parallel: the model has no mixture-of-experts layers"):
        LLM(tiny_model_path, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    path = str(build_tiny_model(tmp_path / "gpt_oss", arch="gpt_oss"))  # 2 experts
    with pytest.raises(ValueError, match=r"its 2 experts do not divide by 4 \(expert parallelism\) "
                                         r"\(sizes that work: 1, 2\)"):
        LLM(path, tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE)
    with pytest.raises(ValueError, match="enable_expert_parallel must be true or false"):
        LLM(path, tensor_parallel_size=2, enable_expert_parallel="yes", **ENGINE)


def test_the_dense_layers_of_a_sparse_model_stay_dense_on_a_later_stage(tmp_path):
    """Qwen-MoE names its dense layers by global index (``mlp_only_layers``,
    ``decoder_sparse_step``): a later stage's local layers keep their global kind."""
    path = str(build_tiny_model(tmp_path / "moe", arch="qwen3_moe", mlp_only_layers=[1]))
    first, last = (_shard(path, 1, 2, r)[0].model.layers[0] for r in range(2))
    assert hasattr(first.mlp, "experts") and not hasattr(last.mlp, "experts")


def test_a_quantized_mixture_of_experts_is_refused_a_split(ray_local, tmp_path):
    path = str(build_tiny_model(tmp_path / "moe", arch="qwen3_moe"))
    with pytest.raises(ValueError, match="qwen3_moe's experts split across ranks from float weights only"):
        LLM(path, pipeline_parallel_size=2, quantization="int8", **ENGINE)


def test_pipeline_stages_hold_their_layers_only(tiny_model_path, full_model):
    (first, l0, _), (last, l1, _) = (_shard(tiny_model_path, 1, 2, r) for r in range(2))
    assert len(first.model.layers) == len(last.model.layers) == 1 and (l0.layers, l1.layers) == (range(0, 1), range(1, 2))
    assert torch.equal(last.model.layers[0].mlp.up_proj.weight, full_model.model.layers[1].mlp.up_proj.weight)
    assert isinstance(first.model.norm, torch.nn.Identity) and isinstance(first.lm_head, torch.nn.Identity)
    assert last.model.embed_tokens.weight.shape[0] == 1  # no table on a later stage
    assert torch.equal(first.model.embed_tokens.weight, full_model.model.embed_tokens.weight)


def test_the_nccl_backend_is_chosen_on_cuda(monkeypatch):
    """No GPU here: the device check is faked and the initialisation mocked."""
    import worker.parallel.group as pg
    from worker.protocol import GroupRank

    calls = {}
    monkeypatch.setattr(pg.dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(pg.dist, "new_group", lambda ranks, timeout=None: calls.setdefault("groups", []).append(ranks))
    monkeypatch.setattr(pg.dist, "TCPStore", lambda *args, **kw: calls.setdefault("store", args))
    layout = rank_layout(SMOLLM2, 3, 1, 1)
    group = pg.ParallelGroup(GroupRank(rank=1, world_size=3, init_method="tcp://10.0.0.1:1234",
                                       shm_path="/dev/shm/unused", timeout_s=5), layout, torch.device("cuda", 0))
    assert calls["init"]["backend"] == "nccl" and calls["store"][:3] == ("10.0.0.1", 1234, 3)
    assert calls["init"]["rank"] == 1 and calls["init"]["world_size"] == 3
    assert calls["groups"] == [[0, 1, 2]] and group.shm is None  # shared memory is a CPU path


# -- end to end ---------------------------------------------------------------------------


def tokens(out: RequestOutput) -> list[int]:
    return out.outputs[0].token_ids


def compare(ref: list[RequestOutput], got: list[RequestOutput], tolerance: float = LOGPROB_TOLERANCE) -> int:
    """Asserts every output equals its reference under the near-tie rule (see the
    module docstring) and its logprobs within ``tolerance`` up to where they part;
    returns the number of near-ties."""
    ties = 0
    for r, g in zip(ref, got, strict=True):
        for rc, gc in zip(r.outputs, g.outputs, strict=True):
            a, b = rc.token_ids, gc.token_ids
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            upto = len(a) if same is None else same
            if rc.logprobs is not None:
                for i in range(upto):
                    assert abs(rc.logprobs[i][a[i]].logprob - gc.logprobs[i][b[i]].logprob) < tolerance
            if same is None:
                assert len(a) == len(b)
                continue
            ra, gb = rc.logprobs[same], gc.logprobs[same]
            assert b[same] in ra and a[same] in gb, f"not a near-tie at {same}: {a} vs {b}"
            assert abs(ra[a[same]].logprob - ra[b[same]].logprob) < 1e-3
            ties += 1
    return ties


@pytest.fixture(scope="module")
def workload():
    ps = prompts(VOCAB, [3, 9, 17, 33, 70, 120, 5, 41], seed=31)
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=20, ignore_eos=True,
                                                  logprobs=2) for i in range(len(ps))]
    return ps, params


ENGINE = dict(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def single(ray_local, tiny_model_path, workload):
    llm = LLM(tiny_model_path, **ENGINE)
    try:
        yield llm.generate(*workload, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,tp,pp,ep", [
    ("qwen3", 2, 1, False), ("gemma3_text", 1, 2, False), ("phi3", 2, 1, False), ("qwen3_moe", 2, 1, False),
    ("qwen3_moe", 1, 2, False), ("gpt_oss", 2, 1, False), ("gpt_oss", 1, 2, False), ("gpt_oss", 2, 1, True)])
def test_the_families_split_answer_as_transformers(ray_local, tmp_path_factory, arch, tp, pp, ep):
    """The families split across ranks (q/k norms, sandwich norms, soft caps, a rotary
    base per layer type, fused projections; mixtures of experts with every expert cut
    per rank, or with expert parallelism each rank's experts whole; gpt-oss's sinks and
    interleaved experts on the generic path): greedy tokens equal to transformers'
    ``generate``, prompts longer than the window (24)."""
    from transformers import AutoModelForCausalLM

    dense = {"mlp_only_layers": [1]} if arch == "qwen3_moe" else {}  # a dense layer among the sparse ones
    path = str(build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, **dense))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts(VOCAB, [5, 40, 70], seed=33)
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep, **ENGINE)
    try:
        outs = llm.generate(ps, GREEDY.clone(logprobs=None, max_tokens=12), use_tqdm=False)
    finally:
        llm.shutdown()
    for p, o in zip(ps, outs):
        assert_greedy_equal(ref, p, o.outputs[0].token_ids, generate(ref, p, 12))


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 2)])
def test_a_split_model_answers_as_one_worker(ray_local, tiny_model_path, workload, single, tp, pp):
    llm = LLM(tiny_model_path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        group = llm.engine.workers[0]
        assert len(group.ranks) == tp * pp
        described = [ray.get(r.actor.health.remote(), timeout=60)["group"] for r in group.ranks]
        assert [d["rank"] for d in described] == list(range(tp * pp))
        if tp > 1 and ShmAllReduce.available():  # one node: the shared-memory path
            assert {d["all_reduce"] for d in described} == {"shared memory"}
        got = llm.generate(*workload, use_tqdm=False)
        stats = llm.engine.stats
    finally:
        llm.shutdown()
    assert compare(single, got) <= 1
    assert 0 < stats.collective < stats.forward + stats.sample


@pytest.mark.parametrize("arch,tp,pp", [("llama", 1, 2), ("llama", 2, 1), ("phi3", 2, 1)])
def test_lora_adapters_through_a_group(ray_local, tiny_model_path, tmp_path, arch, tp, pp):
    """``enable_lora`` on a split model: rows of two adapters (attention only; every
    linear with rsLoRA, Phi-3's fused qkv_proj and gate_up_proj whole) and of the base
    model share the group's steps. Across stages each holds its layers' weights, across
    tensor ranks its cut (B's rows of a column-parallel projection, A's columns of a
    row-parallel one, whose partial products join the all-reduce); each row's greedy
    tokens equal transformers + PEFT's for its adapter, and the driver checks adapters
    against the whole model's linears."""
    from transformers import AutoConfig

    from cluster import LoRARequest
    from lora_adapters import ALL_SEVEN, ATTENTION, make_adapter, peft_model

    path = tiny_model_path if arch == "llama" else str(build_tiny_model(tmp_path / arch, arch=arch))
    every = ALL_SEVEN if arch == "llama" else ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    attention = ATTENTION if arch == "llama" else ["qkv_proj", "o_proj"]
    folders = {"attn": make_adapter(path, tmp_path / "attn", attention, r=8, alpha=16, seed=61),
               "all": make_adapter(path, tmp_path / "all", every, r=4, alpha=8, seed=62, use_rslora=True)}
    names = [None, "attn", "all"] * 2
    ps = prompts(VOCAB, [5, 23, 40, 9, 17, 31], seed=63)
    loras = [None if n is None else LoRARequest(n, 1 + (n == "all"), folders[n]) for n in names]
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_lora=True, max_loras=2, **ENGINE)
    try:
        assert len(llm.engine.workers[0].ranks) == tp * pp
        outs = llm.generate(ps, GREEDY.clone(logprobs=None, max_tokens=12), lora_request=loras, use_tqdm=False)
        layers = {int(name.split(".")[2]) for name in llm.engine.input_processor.loras.targets}
        assert layers == set(range(AutoConfig.from_pretrained(path).num_hidden_layers))
    finally:
        llm.shutdown()
    base = peft_model(path, None)
    for p, name, o in zip(ps, names, outs):
        ref = base if name is None else peft_model(path, folders[name])
        ours = list(o.outputs[0].token_ids)
        assert_greedy_equal(ref, p, ours, generate(ref, p, 12))
        if name is not None:
            assert ours != generate(base, p, 12), f"{name}: the adapter changed nothing"


def test_speculative_decoding_through_a_group(ray_local, tiny_model_path):
    """n-gram drafts on every rank alike, the leader's rejection sampler deciding: the
    same greedy tokens as one worker with the same drafts."""
    ps = [p * 3 for p in prompts(VOCAB, [6, 9, 4], seed=41)]  # repeats: drafts that match
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)

    def run(**split):
        llm = LLM(tiny_model_path, num_spec_tokens=3, **ENGINE, **split)
        try:
            out = llm.generate(ps, greedy, use_tqdm=False)
            return out, llm.engine.metrics.snapshot().spec_decode_num_accepted_tokens
        finally:
            llm.shutdown()

    (ref, _), (got, accepted) = run(), run(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert compare(ref, got) <= 1 and accepted > 0


def test_one_batch_through_the_pipeline_is_bit_identical(ray_local, tiny_model_path, workload):
    """One request at a time: one batch in flight, the arithmetic of one worker (with
    several batches in flight they have other shapes: the near-tie rule applies)."""
    ps, params = workload

    def one_at_a_time(**split):
        llm = LLM(tiny_model_path, **ENGINE, **split)
        try:
            return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(ps[:4], params[:4])]
        finally:
            llm.shutdown()

    ref, got = one_at_a_time(), one_at_a_time(pipeline_parallel_size=2)
    assert [tokens(o) for o in got] == [tokens(o) for o in ref]
    assert compare(ref, got, tolerance=1e-12) == 0


def test_tp_pp_dp_together_with_every_feature(ray_local, tiny_model_path):
    """TP=2 x PP=2 x DP=2 (8 ranks) with a tight KV pool (preemption), a small step
    budget (chunked prefill beside decodes), shared prefixes (prefix caching), n=2
    seeded samples, logprobs and prompt logprobs, a stop string and an abort, against
    one whole worker with the same settings."""
    shared = prompts(VOCAB, [64], seed=5)[0]
    ps = [shared + p for p in prompts(VOCAB, [4, 11, 23, 7, 30, 15], seed=6)] + prompts(VOCAB, [50, 8], seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2, prompt_logprobs=2),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=30, ignore_eos=True, logprobs=1)] * 4
    settings_ = dict(max_num_seqs=6, max_model_len=512, max_num_batched_tokens=32, kv_cache_tokens=320)

    def run(**split):
        llm = LLM(tiny_model_path, **settings_, **split)
        engine = llm.engine
        try:
            first = llm.generate(ps, params, use_tqdm=False)
            text = engine.tokenizer.decode(tokens(first[0])[5:7])
            stop = llm.generate([ps[0]], params[0].clone(stop=[text], include_stop_str_in_output=True),
                                use_tqdm=False)[0]
            engine.add_request("aborted", ps[1], params[0].clone(max_tokens=200, ignore_eos=True))
            while not any(s.output_token_ids for w in engine.workers if w.live for s in w.scheduler.running):
                engine.step()
            engine.abort_request("aborted")
            aborted = [o for o in engine.step() if o.request_id == "aborted"]
            preempted = sum(o.metrics.num_preemptions for o in first)
            cached = sum(o.num_cached_tokens for o in first)
            return first, stop, aborted, preempted, cached
        finally:
            llm.shutdown()

    ref, ref_stop, _, _, _ = run(num_workers=1)
    got, stop, aborted, preempted, cached = run(num_workers=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert compare(ref, got) <= 2
    for r, g in zip(ref, got):
        if r.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert len(r.prompt_logprobs) == len(g.prompt_logprobs) == len(r.prompt_token_ids)
        for pr, pg in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            top = min(pr, key=lambda t: pr[t].rank)
            assert abs(pr[top].logprob - pg[top].logprob) < LOGPROB_TOLERANCE
    assert stop.outputs[0].finish_reason == "stop" and stop.outputs[0].text == ref_stop.outputs[0].text
    assert aborted and aborted[0].outputs[0].finish_reason == "abort"
    assert preempted > 0, "the tight pool should have preempted someone"
    assert cached > 0, "the shared prefix should have been cached"


def test_a_rank_killed_mid_batch_loses_nothing(ray_local, tiny_model_path, workload, single):
    ps, params = workload
    llm = LLM(tiny_model_path, tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    try:
        for i, (p, sp) in enumerate(zip(ps, params)):
            engine.add_request(str(i), p, sp)
        finals: dict[str, RequestOutput] = {}
        killed = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            if killed is not None:
                continue
            group = engine.workers[0]
            if group.live and sum(len(s.output_token_ids) > 0 for s in group.scheduler.running) >= 3:
                follower = next(r for i, r in enumerate(group.ranks) if i != group.leader)
                killed = follower.pid
                os.kill(killed, signal.SIGKILL)
        assert killed and engine.num_worker_failures == 1
        assert all(killed != r.pid for w in engine.workers for r in w.ranks)  # replaced whole
        got = [finals[str(i)] for i in range(len(ps))]
        assert compare(single, got) <= 1
        assert engine.health()["healthy"]
    finally:
        llm.shutdown()


INT4 = dict(quantization="int4", quantization_config={"group_size": 32})


def _run_int4(tiny_model_path, workload, **split):
    llm = LLM(tiny_model_path, **ENGINE, **INT4, **split)
    try:
        per_rank = 14 // split.get("pipeline_parallel_size", 1)  # 2 layers of 7 linears, the stage's share
        ranks = llm.engine.workers[0].ranks or [llm.engine.workers[0]]
        assert all(r.info.quantized == {"int4 g32 sym": per_rank} for r in ranks)
        return llm.generate(*workload, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def int4_single(ray_local, tiny_model_path, workload):
    return _run_int4(tiny_model_path, workload)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_quantized_model_splits_as_it_runs_whole(int4_single, tiny_model_path, workload, tp, pp):
    """int4 weights kept quantized on every rank: each holds its rows of the column-parallel
    layers and its groups of the row-parallel ones, and the group answers as one
    quantized worker does."""
    assert compare(int4_single, _run_int4(tiny_model_path, workload, tensor_parallel_size=tp,
                                          pipeline_parallel_size=pp)) <= 1


def test_a_split_across_quantization_groups_is_refused_naming_the_layer(ray_local, tiny_model_path):
    with pytest.raises(ValueError, match=r"o_proj.weight: tensor parallelism would cut this layer's inputs across"):
        LLM(tiny_model_path, tensor_parallel_size=2, quantization="int4", quantization_config={"group_size": 64},
            **ENGINE)


def test_sizes_that_cannot_work_are_refused_before_anything_starts(ray_local, tiny_model_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not fit .* \(sizes that work: 1, 2, 4\)"):
        LLM(tiny_model_path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        LLM(tiny_model_path, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_layer_partition"):
        LLM(tiny_model_path, pipeline_parallel_size=2, pipeline_layer_partition="1,1,1")


def test_a_group_that_cannot_be_placed_says_what_it_asked_for(ray_local, tiny_model_path):
    with pytest.raises(RuntimeError, match=r"its 2 ranks ask for \{'CPU': 0.5, 'nowhere': 1\} each "
                                           r"\(PACK placement group\); the cluster has"):
        LLM(tiny_model_path, tensor_parallel_size=2, worker_resources={"nowhere": 1}, placement_report_s=1,
            worker_start_timeout_s=3)


# -- SmolLM2 --------------------------------------------------------------------------------

TEXTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
         "Explain what a Ray actor is in one sentence.", "def fibonacci(n):", "Translate 'good morning' to Spanish:"]


@pytest.fixture(scope="module")
def smollm2_single(ray_local):
    llm = LLM(max_num_seqs=8, max_model_len=1024)
    try:
        yield llm.generate(TEXTS, GREEDY.clone(max_tokens=32), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.smollm2
@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2)])
def test_smollm2_split_answers_as_one_worker(ray_local, smollm2_single, tp, pp):
    llm = LLM(max_num_seqs=8, max_model_len=1024, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        got = llm.generate(TEXTS, GREEDY.clone(max_tokens=32), use_tqdm=False)
    finally:
        llm.shutdown()
    ties = compare(smollm2_single, got, tolerance=1e-3)
    assert ties <= 1


@pytest.mark.smollm2
def test_smollm2_served_with_tp_3_answers_the_openai_api(ray_local):
    import json

    from openai import OpenAI

    from helpers import served

    with served({"engine": {"tensor_parallel_size": 3, "max_model_len": 1024}}, "tp3") as server:
        client = OpenAI(base_url=f"{server}/v1", api_key="unused")
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name a city as JSON."}],
            max_tokens=60, temperature=0, logprobs=True, top_logprobs=2,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        )
        choice = reply.choices[0]
        assert isinstance(json.loads(choice.message.content)["city"], str)
        assert len(choice.logprobs.content) == reply.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        import httpx

        health = httpx.get(f"{server}/health", timeout=30).json()
        assert health["ranks_per_worker"] == 3 and health["live_workers"] == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_group_of_one_rank_runs_the_shard_path(tiny_model_path, device):
    """The group code path in one process: a shard of the whole model (TP=PP=1) behind a
    one-rank process group (gloo; NCCL on a GPU machine, which has one GPU) gives the
    plain worker's greedy tokens."""
    import datetime

    import msgspec
    import torch.distributed as dist

    from helpers import make_worker
    from worker.config import WorkerConfig
    from worker.protocol import GroupRank
    from worker.transport.actor import Worker
    from worker_driver import MiniDriver

    ps = prompts(VOCAB, [5, 40, 12], seed=51)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(worker: Worker) -> dict[str, list[int]]:
        d = MiniDriver(worker.step, max_rows=4, token_budget=64, chunk=32, num_blocks=worker._runner.kv.num_blocks)
        for i, p in enumerate(ps):
            d.submit(f"r{i}", p, greedy, arrival_step=i)
        return {rid: r.output for rid, r in d.run().items()}

    ref = run(make_worker(tiny_model_path, device=device))
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    worker = Worker()
    rank = GroupRank(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{store.port}", timeout_s=30)
    worker.load(WorkerConfig(model=tiny_model_path, device=device, max_num_seqs=4, max_model_len=256),
                msgspec.msgpack.encode(rank))
    try:
        assert worker._runner.group is not None
        assert worker._runner.group.backend == ("nccl" if device == "cuda" else "gloo")
        assert run(worker) == ref
    finally:
        worker._runner.group.close()
