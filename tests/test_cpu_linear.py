"""Prepacked oneDNN linears (worker/cpu_linear.py), float32 and bfloat16.

The reference is the exact product in float64 of the same (dtype-rounded) weights and
inputs, not the op itself; a bfloat16 worker is checked against the float32
transformers model on greedy tokens, differences allowed only where bf16 rounding can
flip the choice (a small top-2 gap in float32).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sampler.params import SamplingParams
from test_model_runner import make_worker, prompts
from worker.cpu_linear import PackedLinear, pack_linear_layers, packable_dtypes
from worker_driver import MiniDriver, greedy_divergence

BF16_PACKS = torch.bfloat16 in packable_dtypes()
needs_bf16 = pytest.mark.skipif(not BF16_PACKS, reason="oneDNN has no native bfloat16 matmul on this CPU")
needs_packing = pytest.mark.skipif(not packable_dtypes(), reason="no oneDNN linear in this torch build")

#: |packed - exact| <= REL * |exact| + ABS, per dtype: float32 differs by summation
#: order; bf16 output is one rounding (2**-8 relative) from the float accumulation.
BOUNDS = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2**-7, 1e-2)}


def exact(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    out = x.double() @ lin.weight.double().T
    return out if lin.bias is None else out + lin.bias.double()


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_the_exact_product(dtype, rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 80, bias=bias).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    got = PackedLinear(lin)(x)
    assert got.dtype == dtype and got.shape == (rows, 80)
    want = exact(x, lin)
    rel, abs_ = BOUNDS[dtype]
    err = (got.double() - want).abs()
    assert bool((err <= rel * want.abs() + abs_).all()), f"worst error {err.max().item():.3g}"


@needs_packing
def test_each_packable_dtype_is_packed_and_others_left_alone():
    model = nn.ModuleDict({
        "f32": nn.Linear(16, 8), "bf16": nn.Linear(16, 8).to(torch.bfloat16),
        "f16": nn.Linear(16, 8).to(torch.float16), "f64": nn.Linear(16, 8).to(torch.float64),
    })
    packed = pack_linear_layers(model)
    assert isinstance(model["f32"], PackedLinear)
    assert isinstance(model["bf16"], PackedLinear) == BF16_PACKS
    assert type(model["f16"]) is nn.Linear and type(model["f64"]) is nn.Linear
    assert packed == 1 + BF16_PACKS


@needs_bf16
def test_bfloat16_worker_runs_packed_and_follows_the_float32_model(tiny_model_path):
    """The bf16 worker (packed bf16 linears, bf16 pool) against transformers in float32:
    each greedy sequence equal until a position where float32's top-2 logits are within
    what bf16 rounding moves (logits of this tiny model span about +-10)."""
    from transformers import AutoModelForCausalLM

    w = make_worker(tiny_model_path, dtype="bfloat16")
    assert w._runner.loaded.dtype == torch.bfloat16
    assert w._runner.num_packed_linear > 0
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ps = prompts(400, [3, 70, 17, 40, 5, 33], seed=4)
    driver = MiniDriver(w.step, max_rows=4, token_budget=48, chunk=16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(ps):
        driver.submit(f"r{i}", p, params, arrival_step=i)
    done = driver.run()
    equal_prefix = []
    for i, p in enumerate(ps):
        ours = done[f"r{i}"].output
        with torch.inference_mode():
            ref = reference.generate(torch.tensor([p]), max_new_tokens=len(ours), do_sample=False,
                                     attention_mask=torch.ones(1, len(p), dtype=torch.long), pad_token_id=0,
                                     eos_token_id=None)[0, len(p):].tolist()
        div = greedy_divergence(reference, p, ours, ref)
        if div is None:
            equal_prefix.append(len(ours))
            continue
        pos, gap = div
        assert gap < 0.1, f"request {i} diverged at token {pos} where float32's top-2 gap is {gap:.3g}"
        equal_prefix.append(pos)
    assert sum(equal_prefix) >= len(ps) * 16 // 2, f"bf16 followed float32 for only {equal_prefix} tokens"
