"""Mixture-of-experts layers with each expert's projections packed
(``worker/runner/experts.py``) against transformers' own experts modules.

An experts module of a tiny Qwen3-MoE (SiLU gate, no biases) and of gpt-oss (biases,
interleaved gate and up rows, its clamped gate), copied, unstacked and packed, against
the original on the same tokens and routing: hypothesis over the token count, which
experts get tokens (none, one, all) and the routing weights. A token's output is the
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


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def pair(request):
    reference = experts_of(request.param)
    packed = copy.deepcopy(reference)
    packed.config = copy.deepcopy(reference.config)  # its own: the packed implementation is set on it
    holder = torch.nn.Module()
    holder.experts = packed
    assert unstack_experts(holder) == 1
    assert packed.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert pack_linear_layers(holder, load()) == 2 * EXPERTS
    assert all(isinstance(m, PanelLinear) for m in (*packed.expert_up, *packed.expert_down))
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
