"""Mixture-of-experts layers with each expert's projections packed
(``worker/runner/experts.py``) against transformers' own experts modules.

An experts module of a tiny Qwen3-MoE (SiLU gate, no biases) and of gpt-oss (biases,
interleaved gate and up rows, its clamped gate), copied, unstacked and packed, against
the original on the same tokens and routing: hypothesis over the token count, which
experts get tokens (none, one, all) and the routing weights; both the per-expert Python
loop and the one-call kernel (``worker/cpu/moe_experts.py``). A token's output is the
same alone as in any batch, bit for bit. The whole models' greedy tokens against
transformers are in the families sweep (``tests/test_model_families.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from hypothesis_budget import examples
from worker.cpu.kernels import load
from worker.cpu.moe_experts import install_native_experts
from worker.cpu.packed_linear import PanelLinear, pack_linear_layers
from worker.runner.experts import EXPERTS_IMPLEMENTATION, unstack_experts

pytestmark = pytest.mark.skipif(load() is None, reason="the CPU kernels cannot be built here")

HIDDEN, EXPERTS = 64, 4


def experts_of(model_type: str) -> torch.nn.Module:
    extra = {"qwen3_moe": dict(num_experts=EXPERTS, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]),
             "gpt_oss": dict(num_local_experts=EXPERTS, intermediate_size=32, head_dim=16)}[model_type]
    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=64, num_experts_per_tok=2, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.model.layers[0].mlp.experts


def packed_copy(reference: torch.nn.Module, native: bool, gemm_from_rows: int = 0) -> torch.nn.Module:
    packed = copy.deepcopy(reference)
    packed.config = copy.deepcopy(reference.config)  # its own: the packed implementation is set on it
    holder = torch.nn.Module()
    holder.experts = packed
    assert unstack_experts(holder) == 1
    assert packed.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert pack_linear_layers(holder, load(), gemm_from_rows) == 2 * EXPERTS
    assert all(isinstance(m, PanelLinear) for m in (*packed.expert_up, *packed.expert_down))
    if native:
        assert install_native_experts(holder, load()) == 1
    return packed


@pytest.fixture(scope="module", params=["qwen3_moe-loop", "qwen3_moe-native", "gpt_oss-loop", "gpt_oss-native"])
def pair(request):
    family, path = request.param.split("-")
    reference = experts_of(family)
    packed = packed_copy(reference, native=path == "native")
    assert reference.config._experts_implementation != EXPERTS_IMPLEMENTATION
    return reference, packed


def routing(tokens: int, used: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's two distinct experts from ``used`` (or the same one twice when only
    one is used, as a router never does but the experts must still sum), and weights."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.stack([torch.randperm(len(used), generator=g)[:2] if len(used) > 1 else torch.zeros(2, dtype=torch.long)
                        for _ in range(tokens)])
    index = torch.tensor(used)[pick]
    weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    return index, weights


@settings(max_examples=examples(30), deadline=None)
@given(tokens=st.integers(1, 40), used=st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=EXPERTS, unique=True),
       seed=st.integers(0, 2**16))
def test_packed_experts_equal_transformers_experts(pair, tokens, used, seed):
    reference, packed = pair
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    index, weights = routing(tokens, sorted(used), seed)
    with torch.no_grad():
        want = reference(hidden, index, weights)
        got = packed(hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_tokens_output_does_not_depend_on_its_batch(pair):
    _, packed = pair
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(23, HIDDEN, generator=g)
    index, weights = routing(23, list(range(EXPERTS)), 3)
    with torch.no_grad():
        batch = packed(hidden, index, weights)
        for t in (0, 7, 22):
            alone = packed(hidden[t : t + 1], index[t : t + 1], weights[t : t + 1])
            assert torch.equal(alone[0], batch[t])


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_kernel_serves_decode_steps_and_leaves_long_prefills_to_the_library_gemm(family):
    """With a library GEMM kept for calls of ``gemm_from_rows`` rows or more, a step in
    which an expert gets that many rows runs the Python loop (its linears hand those
    calls to the GEMM); smaller steps run in the kernel. Both answer as transformers."""
    reference = experts_of(family)
    packed = packed_copy(reference, native=True, gemm_from_rows=8)
    g = torch.Generator().manual_seed(5)
    for tokens, served in ((3, True), (30, False)):
        hidden = torch.randn(tokens, HIDDEN, generator=g)
        index, weights = routing(tokens, list(range(EXPERTS)), tokens)
        with torch.no_grad():
            assert (packed.native_experts(hidden, index, weights) is not None) is served
            torch.testing.assert_close(packed(hidden, index, weights), reference(hidden, index, weights),
                                       rtol=1e-4, atol=1e-5)


def test_an_expert_index_out_of_range_is_an_error_not_a_read_past_the_weights():
    packed = packed_copy(experts_of("qwen3_moe"), native=True)
    index = torch.tensor([[0, EXPERTS]])
    with pytest.raises(RuntimeError, match="expert index 4 out of range"):
        packed.native_experts(torch.randn(1, HIDDEN), index, torch.ones(1, 2) / 2)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_parallel_shares_sum_to_the_whole_layer(family):
    """Expert parallelism: two ranks' shares of the experts (each skipping the pairs
    routed to the other's), in the kernel and in the Python loop, add up to
    transformers' layer; a token routed only elsewhere gets zeros."""
    from torch import nn

    from worker.cpu.moe_experts import NativeExperts, native_gate
    from worker.runner.experts import hold_experts

    reference = experts_of(family)
    packed = packed_copy(reference, native=False)
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(17, HIDDEN, generator=g)
    index, weights = routing(17, list(range(EXPERTS)), 9)
    index[0] = torch.tensor([0, 1])  # token 0: only the first rank's experts
    half = EXPERTS // 2
    kernel, loop = [], []
    for first in (0, half):
        kernel.append(NativeExperts(list(packed.expert_up)[first : first + half],
                                    list(packed.expert_down)[first : first + half], load(), native_gate(packed),
                                    first, EXPERTS))
        share = packed_copy(reference, native=False)
        share.expert_up = nn.ModuleList(list(share.expert_up)[first : first + half])
        share.expert_down = nn.ModuleList(list(share.expert_down)[first : first + half])
        share.num_experts = half
        hold_experts(share, first, EXPERTS)
        loop.append(share)
    with torch.no_grad():
        want = reference(hidden, index, weights)
        for parts in ([k(hidden, index, weights) for k in kernel], [s(hidden, index, weights) for s in loop]):
            assert not parts[1][0].any()
            torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-4, atol=1e-5)
