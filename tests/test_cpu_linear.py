"""Prepacked linears (worker/cpu/packed_linear.py): oneDNN's, float32 and bfloat16,
MKL's packed sgemm (float32, prefill-sized calls), and the column-panel kernel
(worker/cpu/csrc/panel_linear.cpp), float32, on every instruction set this CPU has.

The reference is the exact product in float64 of the same (dtype-rounded) weights and
inputs, not the op itself; a bfloat16 worker is checked against the float32
transformers model on greedy tokens, differences allowed only where bf16 rounding can
flip the choice (a small top-2 gap in float32).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import make_worker, prompts
from sampler.params import SamplingParams
from worker.cpu.kernels import load as load_cpu_kernels
from worker.cpu.packed_linear import (
    MKL_PACK_ROWS,
    MklPackedWeight,
    PackedLinear,
    PanelLinear,
    mkl_packed_linear_available,
    pack_linear_layers,
    packable_dtypes,
)
from worker_driver import MiniDriver, greedy_divergence

OPS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
ISAS = OPS.panel_isas() if OPS is not None else []

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


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 16, 28, 30, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_equals_the_exact_product(isa, rows, bias):
    """Every row-block size (1 to 12, remainders, and a short remainder shared with the
    block before it: 13 = 7 + 6, 16 = 8 + 8, 28 = 12 + 8 + 8), an odd number of panels
    (5: the last AVX-512 pair is a single panel) and an odd inner size."""
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(97, 80, bias=bias)
    x = torch.randn(rows, 97, generator=g)
    got = torch.empty(rows, 80)
    OPS.panel_linear(got, x, OPS.pack_panels(lin.weight.detach()), None if lin.bias is None else lin.bias.detach(), isa)
    want = exact(x, lin)
    rel, abs_ = BOUNDS[torch.float32]
    err = (got.double() - want).abs()
    assert bool((err <= rel * want.abs() + abs_).all()), f"{isa}: worst error {err.max().item():.3g}"


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_a_row_of_a_panel_linear_does_not_depend_on_its_batch(isa):
    """Each output is one chain of FMAs over k, whatever the rows beside it: bit for bit."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 200, generator=g)
    panels = OPS.pack_panels(weight)
    x = torch.randn(37, 200, generator=g)
    alone = [torch.empty(1, 48) for _ in range(37)]
    for r, out in enumerate(alone):
        OPS.panel_linear(out, x[r:r + 1].contiguous(), panels, None, isa)
    for m in (37, 16, 28):  # blocks of 12 + 1; 8 + 8; 12 + 8 + 8
        batch = torch.empty(m, 48)
        OPS.panel_linear(batch, x[:m].contiguous(), panels, None, isa)
        for r in range(m):
            assert torch.equal(alone[r][0], batch[r]), (m, r)


@needs_kernels
def test_panel_linear_refuses_what_it_cannot_run():
    panels = OPS.pack_panels(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        OPS.pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        OPS.panel_linear(torch.empty(4, 32), torch.randn(8, 4).t(), panels, None)
    with pytest.raises(RuntimeError, match="y must be"):
        OPS.panel_linear(torch.empty(4, 16), torch.randn(4, 8), panels, None)


@needs_kernels
@needs_packing
def test_float32_goes_to_panels_where_it_can_and_to_onednn_elsewhere():
    model = nn.ModuleDict({
        "f32": nn.Linear(16, 32), "f32_odd": nn.Linear(16, 10), "bf16": nn.Linear(16, 32).to(torch.bfloat16),
    })
    x = torch.randn(3, 16)
    want = model["f32"](x)
    assert pack_linear_layers(model, OPS) == 2 + BF16_PACKS
    assert isinstance(model["f32"], PanelLinear) and isinstance(model["f32_odd"], PackedLinear)
    assert isinstance(model["bf16"], PackedLinear) == BF16_PACKS
    assert torch.allclose(model["f32"](x.unsqueeze(0)), want.unsqueeze(0), rtol=1e-5, atol=1e-5)  # any leading dims
    assert model["f32"].weight.shape == (32, 16)


@needs_bf16
def test_bfloat16_worker_runs_packed_and_follows_the_float32_model(tiny_model_path):
    """The bf16 worker (packed bf16 linears, bf16 pool) against transformers in float32:
    each greedy sequence equal until a position where float32's top-2 logits are within
    what bf16 rounding moves (logits of this tiny model span about +-10)."""
    from transformers import AutoModelForCausalLM

    w = make_worker(tiny_model_path, dtype="bfloat16")
    assert w._runner.loaded.dtype == torch.bfloat16
    assert w._runner.backend.num_packed_linear > 0
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


@needs_kernels
def test_the_default_worker_runs_its_float32_linears_on_panels(tiny_model_path):
    w = make_worker(tiny_model_path)
    kinds = {type(m).__name__ for m in w._runner.model.modules()}
    assert "PanelLinear" in kinds
    off = make_worker(tiny_model_path, cpu_panel_linear=False)
    assert "PanelLinear" not in {type(m).__name__ for m in off._runner.model.modules()}


@needs_kernels
@needs_packing
@pytest.mark.parametrize("use_mkl", [True, False] if mkl_packed_linear_available() else [False])
def test_panels_hand_prefill_sized_calls_to_their_library_copy(use_mkl):
    """With ``gemm_from_rows``, calls of that many rows or more run on a library GEMM's
    copy (what a prefill chunk gets: MKL's packed sgemm or oneDNN's packed linear),
    smaller ones on the panels; both give the product. The output embedding keeps one
    copy (only sampled rows reach it)."""
    torch.manual_seed(3)
    linear = nn.Linear(64, 48)
    hybrid = PanelLinear(linear, OPS, gemm_from_rows=8, use_mkl=use_mkl)
    assert isinstance(hybrid.gemm, MklPackedWeight if use_mkl else PackedLinear)
    assert PanelLinear(linear, OPS).gemm is None
    for rows in (1, 7, 8, 33, MKL_PACK_ROWS + 5):
        x = torch.randn(rows, 64)
        want = exact(x, linear).float()
        got = hybrid(x)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), rows
        # below the threshold the panels ran, at or above it the library did: bit for bit
        if rows < 8:
            ran = torch.empty(rows, 48)
            OPS.panel_linear(ran, x, hybrid.panels, hybrid.bias)
        elif use_mkl:
            ran = torch.ops.mkl._mkl_linear(x, hybrid.gemm.packed, linear.weight.detach(), hybrid.bias, rows)
        else:
            ran = torch.ops.mkldnn._linear_pointwise(x, hybrid.gemm.packed, hybrid.bias, "none", [], "")
        assert torch.equal(got, ran), rows

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 32)
            self.head = nn.Linear(16, 64, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    model = Tiny()
    pack_linear_layers(model, OPS, gemm_from_rows=4, gemm_library="mkl")
    assert model.proj.gemm is not None and model.head.gemm is None
    assert isinstance(model.proj.gemm, MklPackedWeight) == mkl_packed_linear_available()
    onednn = Tiny()
    pack_linear_layers(onednn, OPS, gemm_from_rows=4, gemm_library="onednn")
    assert isinstance(onednn.proj.gemm, PackedLinear)
    pack_free = Tiny()
    pack_linear_layers(pack_free, OPS)
    assert pack_free.proj.gemm is None


@pytest.mark.skipif(not mkl_packed_linear_available(), reason="no MKL in this torch build")
@pytest.mark.parametrize("in_features,out_features,bias", [(64, 48, True), (576, 960, False), (1536, 576, True)])
def test_the_mkl_copy_serves_any_row_count(in_features, out_features, bias):
    """MKL's copy is packed for MKL_PACK_ROWS rows; every call passes its own row count,
    and the product is right at all of them (what the load-time check relies on), the
    bias included, against the exact float64 product."""
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    gemm = MklPackedWeight(linear)
    for rows in (0, 1, 2, 15, 100, 320, MKL_PACK_ROWS - 1, MKL_PACK_ROWS, 700):
        x = torch.randn(rows, in_features)
        got = gemm(x)
        assert got.shape == (rows, out_features)
        want = exact(x, linear)
        err = (got.double() - want).abs()
        assert (err <= 1e-5 * want.abs() + 1e-4).all(), (rows, err.max().item())


@needs_kernels
def test_the_worker_threshold_reaches_the_linears_and_is_validated(tiny_model_path):
    from cluster.config import EngineConfig

    on = make_worker(tiny_model_path, cpu_gemm_from_rows=100)
    panels = [m for m in on._runner.model.modules() if isinstance(m, PanelLinear)]
    with_copy = [m for m in panels if m.gemm is not None]
    assert with_copy and all(m.gemm_from_rows == 100 for m in with_copy)
    off = make_worker(tiny_model_path, cpu_gemm_from_rows=0)
    assert all(m.gemm is None for m in off._runner.model.modules() if isinstance(m, PanelLinear))
    with pytest.raises(ValueError, match="cpu_gemm_from_rows"):
        EngineConfig(cpu_gemm_from_rows=-1)


@pytest.mark.skipif(not mkl_packed_linear_available(), reason="no MKL in this torch build")
def test_the_large_calls_library_is_the_faster_one_unless_set(monkeypatch):
    """``cpu_gemm_library``: "mkl" and "onednn" are taken as said, without timing;
    "auto" races the two on the probe and takes the faster (either way round: MKL led on
    a Xeon, oneDNN on a Zen 5). The race itself times both libraries for real."""
    from worker.cpu import packed_linear

    probe = nn.Linear(64, 96)
    real = packed_linear.time_gemms(probe, rows=32, rounds=2)
    assert set(real) == {"mkl", "onednn"} and all(0 < t < 1 for t in real.values())

    def no_race(*a, **k):
        raise AssertionError("timed although the library was set")

    monkeypatch.setattr(packed_linear, "time_gemms", no_race)
    assert packed_linear.choose_gemm_library(probe, "mkl")[0] is True
    assert packed_linear.choose_gemm_library(probe, "onednn")[0] is False
    for mkl, onednn, want in ((0.002, 0.004, True), (0.009, 0.004, False)):
        monkeypatch.setattr(packed_linear, "time_gemms", lambda *a, mkl=mkl, onednn=onednn, **k: {"mkl": mkl, "onednn": onednn})
        use_mkl, why = packed_linear.choose_gemm_library(probe, "auto")
        assert use_mkl is want and ("MKL" if want else "oneDNN") in why.split()[0]


@needs_kernels
@pytest.mark.skipif(not mkl_packed_linear_available(), reason="no MKL in this torch build")
def test_the_worker_takes_the_library_it_is_given(tiny_model_path):
    """The worker setting reaches the panels' large-call copies; a bad value is a
    ValueError naming the field."""
    from cluster.config import EngineConfig

    for library, kind in (("mkl", MklPackedWeight), ("onednn", PackedLinear)):
        worker = make_worker(tiny_model_path, cpu_gemm_from_rows=100, cpu_gemm_library=library)
        copies = [m.gemm for m in worker._runner.model.modules() if isinstance(m, PanelLinear) and m.gemm is not None]
        assert copies and all(isinstance(g, kind) for g in copies), library
    with pytest.raises(ValueError, match="cpu_gemm_library"):
        EngineConfig(cpu_gemm_library="openblas")


def test_an_empty_linear_is_left_unpacked():
    """A zero-width layer (DeepSeek-V3 with n_shared_experts 0 builds one) stays as it is:
    oneDNN cannot pack it (a floating-point exception)."""
    from torch import nn

    from worker.cpu.kernels import load
    from worker.cpu.packed_linear import pack_linear_layers

    model = nn.Sequential(nn.Linear(32, 0), nn.Linear(32, 16))
    assert pack_linear_layers(model, load()) == 1
    assert type(model[0]) is nn.Linear and model[0](torch.randn(2, 32)).shape == (2, 0)
