"""The fused CPU decoder path (worker/cpu/fused_decoder.py,
worker/cpu/csrc/layer_ops.cpp) against the transformers forward it replaces.

Every step of a continuous-batching run (prefill chunks from scratch and continuing a
cached prompt, decodes, speculative drafts) goes through both: the transformers model
first, then the fused path over the same plan and pool, and their logits must agree.
Greedy agreement with ``generate`` on the fused path is covered where the default tiny
Llama runs (test_model_runner.py, test_prefix_caching.py's sliding windows).
"""

from __future__ import annotations

import pytest
import torch

from helpers import make_worker, prompts
from sampler.params import SamplingParams
from tiny_model import build_tiny_model
from worker.cpu.kernels import load as load_cpu_kernels
from worker_driver import MiniDriver

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="the CPU kernels cannot be built here")

VOCAB = 400


def tiny(tmp_path_factory, arch: str) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch))


def run_both_ways(path: str, tol: float, **config) -> tuple[int, float]:
    """A batch run where each forward goes through transformers and then the fused
    path; returns (steps compared, the largest logit difference). The run continues on
    the transformers logits, so both see the same history."""
    w = make_worker(path, **config)
    runner = w._runner
    fused = runner.backend.decoder
    assert fused is not None, "the fused path should apply to this model"
    model = runner.model
    worst = [0, 0.0]

    def both(input_ids, position_ids, plan, rows):
        ref = model(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), use_cache=False,
                    logits_to_keep=rows, attention_plan=plan).logits[0]
        ours = fused.forward(input_ids, position_ids, plan, rows)
        assert ours.shape == ref.shape and ours.dtype == ref.dtype
        diff = (ours.float() - ref.float()).abs().max().item()
        assert diff <= tol, f"step with {len(input_ids)} tokens: logits differ by {diff:.3g}"
        worst[0] += 1
        worst[1] = max(worst[1], diff)
        return ref

    runner.backend.decoder = type("Both", (), {"forward": staticmethod(both)})()
    # Chunks of 16 (batched attention rows) and 40 (prefill rows continuing a cached
    # prompt); prompts longer than the mistral window (24).
    driver = MiniDriver(w.step, max_rows=4, token_budget=56, chunk=40)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts(VOCAB, [3, 70, 17, 45, 90, 6], seed=7) + [prompts(VOCAB, [5], seed=8)[0] * 8]):
        driver.submit(f"r{i}", p, params, arrival_step=2 * i)
    done = driver.run()
    assert all(len(r.output) == 12 and r.error is None for r in done.values())
    return worst[0], worst[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text",
                                  "qwen3_moe", "mixtral", "gpt_oss"])
def test_fused_logits_match_the_transformers_forward(tmp_path_factory, arch):
    steps, worst = run_both_ways(tiny(tmp_path_factory, arch), tol=1e-4)
    assert steps > 20


def test_fused_logits_match_with_speculative_drafts(tmp_path_factory):
    steps, _ = run_both_ways(tiny(tmp_path_factory, "llama"), tol=1e-4, num_spec_tokens=3)
    assert steps > 10


def test_fused_logits_match_in_bfloat16(tmp_path_factory):
    """bf16 rounds at different points than transformers' op-by-op forward (the fused
    ops accumulate in float and round once); logits of this tiny model span ~±10."""
    run_both_ways(tiny(tmp_path_factory, "llama"), tol=0.15, dtype="bfloat16")


def test_merged_projections_compute_the_models_own_projections(tmp_path_factory):
    """The fused path runs each layer's q/k/v and gate/up as one merged matmul; every
    projection, still a module of the model (a slice of the merged one), must give what
    the checkpoint's separate linear gives (Qwen2: q, k and v carry biases)."""
    from transformers import AutoModelForCausalLM

    path = tiny(tmp_path_factory, "qwen2")
    runner = make_worker(path)._runner
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    x = torch.randn(5, runner.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer, ref, fused in zip(runner.model.model.layers, reference.model.layers, runner.backend.decoder.layers):
        assert len(fused.qkv) == 1 and len(fused.gate_up) == 1, "the fused layer should run the merged linears"
        for parent, ref_parent, names in ((layer.self_attn, ref.self_attn, ("q_proj", "k_proj", "v_proj")),
                                          (layer.mlp, ref.mlp, ("gate_proj", "up_proj"))):
            for name in names:
                torch.testing.assert_close(getattr(parent, name)(x), getattr(ref_parent, name)(x), rtol=1e-5, atol=1e-5)


def test_the_switch_keeps_the_transformers_forward(tmp_path_factory):
    """(The generic families keep it too: the families sweep checks each family's path.)"""
    assert make_worker(tiny(tmp_path_factory, "llama"), cpu_fused_decoder=False)._runner.backend.decoder is None


def test_layer_ops_refuse_bad_arguments():
    ops = load_cpu_kernels()
    pool = torch.zeros(4, 2, 16, 8)
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.rotary_to_cache(q, k, v, cos, sin, pool, pool.clone(), torch.tensor([0, 1, 2, 3, 4, 999]))
    with pytest.raises(RuntimeError, match="widths"):
        ops.rotary_to_cache(q, torch.randn(3, 8), v, cos, sin, pool, pool.clone(), torch.arange(6))
    with pytest.raises(RuntimeError, match="shapes differ"):
        ops.rms_norm(torch.empty(3, 8), torch.randn(3, 8), None, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.silu_mul(torch.empty(2, 4), torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.silu_mul(torch.empty(4), torch.randn(4), torch.randn(4))
    with pytest.raises(RuntimeError, match="contiguous rows"):  # columns strided
        ops.silu_mul(torch.empty(2, 4), torch.randn(4, 2).t(), torch.randn(2, 4))


def test_rotary_and_norms_match_their_definitions():
    """Against the written-out formulas (transformers' RMSNorm, rotate-half rotary,
    SiLU), independent of any model."""
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g), torch.randn(24, generator=g)
    out, summed = torch.empty(5, 24), res.clone()
    ops.rms_norm(out, x, summed, w, 1e-5)
    expect_sum = res + x
    expect = w * (expect_sum * torch.rsqrt(expect_sum.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(summed, expect_sum)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    gate, up = torch.randn(7, 33, generator=g) * 8, torch.randn(7, 33, generator=g)
    act = torch.empty_like(gate)
    ops.silu_mul(act, gate, up)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    ops.gelu_tanh_mul(act, gate, up)
    torch.testing.assert_close(act, torch.nn.functional.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)
    # gate and up as the two halves of one merged projection's rows (strided rows),
    # enough elements that the vectorised loop and several threads take part
    gate_up = torch.randn(9, 2 * 1000, generator=g) * 8
    act = torch.empty(9, 1000)
    ops.silu_mul(act, *gate_up.split(1000, dim=-1))
    torch.testing.assert_close(act, torch.nn.functional.silu(gate_up[:, :1000]) * gate_up[:, 1000:], rtol=1e-5, atol=1e-5)
    # rotary: 2 tokens, 2 query heads, 1 KV head, head_dim 8, blocks of 4 slots
    q, k, v = torch.randn(2, 16, generator=g), torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    angle = torch.randn(2, 4, generator=g)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)

    def rotated(t):
        t = t.view(2, -1, 8)
        half = torch.cat([-t[..., 4:], t[..., :4]], -1)
        return t * cos[:, None] + half * sin[:, None]

    expect_q, expect_k = rotated(q), rotated(k)
    k_pool, v_pool = torch.zeros(3, 1, 4, 8), torch.zeros(3, 1, 4, 8)
    ops.rotary_to_cache(q, k, v, cos, sin, k_pool, v_pool, torch.tensor([9, 2]))
    torch.testing.assert_close(q.view(2, 2, 8), expect_q)
    flat_k, flat_v = k_pool.view(-1, 8), v_pool.view(-1, 8)
    torch.testing.assert_close(flat_k[[9, 2]], expect_k.view(2, 8))
    torch.testing.assert_close(flat_v[[9, 2]], v)


def test_bfloat16_layer_ops_round_as_torch_does():
    """The bf16 ops convert with bit operations (vectorized) instead of c10's calls; the
    roundings must be torch's: round to nearest even, NaN stays NaN, infinities and
    overflow to infinity. silu_mul is bit-exact against torch's silu, rounded, times
    up, rounded; the residual add of rms_norm likewise; the norm within one rounding."""
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8,
                            3.39e38, -3.39e38, 1e-40])
    up = torch.cat([special, torch.randn(4000, generator=g) * 100]).view(-1, 10).bfloat16()
    gate = (torch.randn(up.shape, generator=g) * 8).bfloat16()
    gate[0, :3] = torch.tensor([80.0, -80.0, 0.0])
    act = torch.empty_like(up)
    ops.silu_mul(act, gate, up)
    want = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    assert torch.equal(act.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
    assert bool(act.isnan().eq(want.isnan()).all())
    x = (torch.randn(6, 40, generator=g) * 3).bfloat16()
    res = (torch.randn(6, 40, generator=g) * 3).bfloat16()
    w = torch.randn(40, generator=g).bfloat16()
    out, summed = torch.empty_like(x), res.clone()
    ops.rms_norm(out, x, summed, w, 1e-5)
    want_sum = (res.float() + x.float()).bfloat16()
    assert torch.equal(summed.view(torch.int16), want_sum.view(torch.int16))
    s = want_sum.float()
    normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    want_out = (w.float() * normed.float()).bfloat16()
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2**-7, atol=1e-6)
