"""The linear over quantized weights (worker/cpu/csrc/quant_linear.cpp behind
worker/cpu/quant_linear.py), the torch reference path (worker/quant/linear.py) and the
swap of one for the other.

The kernel dequantizes each weight in registers, ``fma(code, scale, offset)`` (one
rounding), and accumulates each output as one FMA chain over k in order: on AVX-512 and
AVX2 its result is the float panel kernel's (``panel_linear``) on those weights, bit for
bit, whatever the rows beside it; on the plain loops it is close. ``QuantizedWeight
.dequantize`` rounds the product and the sum apart: the same weights wherever
``scale * code`` is exact in float32 (every format raydecode reads: half-precision
scales), within an ulp otherwise. The weights the kernel holds are computed here, rounded
once, by ``fma_float32`` (float64 arithmetic with its error term), so exactness is
checked for float32 scales too.

Every result is also checked against the product in float64 of the exact weights,
within the rounding bound of a float32 dot product of that length.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import worker.cpu.quant_linear as quant_linear_module
import worker.quant.linear as torch_linear_module
from hypothesis_budget import examples
from worker.cpu.kernels import load as load_cpu_kernels
from worker.cpu.quant_linear import GEMM_FROM_ROWS, QuantPanelLinear, quantize_linear_layers
from worker.quant.linear import QuantizedLinear
from worker.quant.weight import QuantizedWeight

OPS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(OPS is None, reason="the CPU kernels cannot be built here")
ISAS = OPS.quant_isas() if OPS is not None else []
#: the instruction sets whose result is the float panel kernel's bit for bit
EXACT_ISAS = ("avx512", "avx2")
U = 2.0**-24  # float32's unit roundoff


# -- weights and references -------------------------------------------------------------------


def random_weight(gen: torch.Generator, n: int, k: int, bits: int, group: int, scales: str = "fp16",
                  offsets: str = "float32") -> QuantizedWeight:
    """Random codes (all of ``2**bits``), scales of either sign that are exact in half
    precision (``"fp16"``: ``scale * code`` exact in float32; normal and subnormal half
    floats) or carry a full float32 mantissa (``"float32"``), and offsets that are zero,
    a zero point times the scale, or arbitrary float32 values around the weights' range."""
    groups = k // group
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    sign = torch.where(torch.rand(n, groups, generator=gen) < 0.2, -1.0, 1.0)
    if scales == "fp16":
        exponent = torch.randint(-24, 3, (n, groups), generator=gen).float()
        s = (sign * (1 + torch.rand(n, groups, generator=gen)) * torch.exp2(exponent)).half().float()
    else:
        s = sign * torch.rand(n, groups, generator=gen).add_(0.05) * 10.0 ** torch.randint(-3, 2, (n, groups),
                                                                                           generator=gen).float()
    if offsets == "zero":
        o = torch.zeros(n, groups)
    elif offsets == "zero_point":
        o = -torch.randint(0, 2**bits, (n, groups), generator=gen).float() * s
    else:
        o = -s.abs() * torch.rand(n, groups, generator=gen) * 2**bits + torch.randn(n, groups, generator=gen) * s
    return QuantizedWeight.from_codes(codes, s.float(), o.float(), bits, group, f"test {bits}-bit g{group} {scales}")


def group_values(w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scales and offsets per weight ``[N, K]``, as float32 arrays."""
    g = w.group_size
    return (w.unpacked_codes().numpy().astype(np.float32), w.scales.repeat_interleave(g, dim=1).numpy(),
            w.offsets.repeat_interleave(g, dim=1).numpy())


def fma_float32(c: np.ndarray, s: np.ndarray, o: np.ndarray) -> np.ndarray:
    """``c * s + o`` rounded once to float32 (what an FMA gives): ``c * s`` is exact in
    float64 (at most 24 + 8 significant bits); the sum in float64 with its exact error
    (Knuth's TwoSum); rounding that float64 to float32 is the correct rounding except
    when it lies exactly halfway between two float32 values and the error is not zero,
    where the error's sign decides."""
    t = c.astype(np.float64) * s.astype(np.float64)
    o64 = o.astype(np.float64)
    d = t + o64
    bp = d - t
    err = (t - (d - bp)) + (o64 - bp)
    f = d.astype(np.float32)
    f64 = f.astype(np.float64)
    lo = np.where(f64 <= d, f, np.nextafter(f, np.float32(-np.inf)))
    hi = np.where(f64 >= d, f, np.nextafter(f, np.float32(np.inf)))
    mid = (lo.astype(np.float64) + hi.astype(np.float64)) / 2
    tie = (err != 0) & (d == mid) & (lo != hi)
    return np.where(tie, np.where(err > 0, hi, lo), f)


def kernel_weights(w: QuantizedWeight) -> torch.Tensor:
    """The float32 weights the kernel computes in registers."""
    return torch.from_numpy(fma_float32(*group_values(w)))


def exact_weights(w: QuantizedWeight) -> torch.Tensor:
    """The weights in float64 (``c * s`` exact, the sum within 2**-53)."""
    c, s, o = group_values(w)
    return torch.from_numpy(c.astype(np.float64) * s.astype(np.float64) + o.astype(np.float64))


def reference(x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The product in float64 and the bound a float32 result may be off by: a dot product
    of K terms in any order, on weights rounded once, then the bias added, is within
    (K + 2) u of sum |x||w| + |bias| (doubled: a margin, and the plain loops' unfused
    products)."""
    want = x.double() @ w64.T
    size = x.abs().double() @ w64.abs().T
    if bias is not None:
        want = want + bias.double()
        size = size + bias.abs().double()
    return want, 2 * (x.shape[1] + 4) * U * size + 1e-37


def assert_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"{what}: worst error {err.max().item():.3g}, " \
                                       f"{(err / bound).max().item():.2f} of the bound"


def panel(x: torch.Tensor, w32: torch.Tensor, bias: torch.Tensor | None, isa: str) -> torch.Tensor:
    out = torch.empty(x.shape[0], w32.shape[0])
    OPS.panel_linear(out, x, OPS.pack_panels(w32), bias, isa)
    return out


def quant(layer: QuantPanelLinear, x: torch.Tensor, isa: str) -> torch.Tensor:
    return layer.matmul(x, isa)


# -- 1. the kernel against the float panels and the exact product ------------------------------


@needs_kernels
@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.sampled_from([4, 5, 6, 8]), panels=st.integers(1, 6), group=st.sampled_from([16, 32, 64, 128]),
       data=st.data(), rows=st.integers(1, 64), bias=st.booleans(), scales=st.sampled_from(["fp16", "float32"]),
       offsets=st.sampled_from(["zero", "zero_point", "float32"]), seed=st.integers(0, 2**31))
def test_the_kernel_is_the_float_panel_linear_on_the_dequantized_weights(bits, panels, group, data, rows, bias,
                                                                          scales, offsets, seed):
    k = group * data.draw(st.integers(1, 600 // group), label="groups")
    n = 16 * panels
    gen = torch.Generator().manual_seed(seed)
    w = random_weight(gen, n, k, bits, group, scales, offsets)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen) * 2.0 ** torch.randint(-4, 5, (rows, 1), generator=gen)
    layer = QuantPanelLinear(w, b, OPS)
    held = kernel_weights(w)
    dequantized = w.dequantize()
    # The library path's dequantizer holds the same weights (std::fma).
    assert torch.equal(OPS.dequantize_quant_panels(layer.codes, layer.groups, group, 0, panels).t(), held)
    scale_times_code_exact = scales == "fp16"
    if scale_times_code_exact:
        assert torch.equal(dequantized, held)  # product exact: one rounding either way
    want, bound = reference(x, exact_weights(w), b)
    for isa in ISAS:
        got = quant(layer, x, isa)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert_close(got, want, bound, isa)
        if isa not in EXACT_ISAS:
            continue  # the plain loops: close (the float panels' plain loop may not fuse its products)
        assert torch.equal(got, panel(x, held, b, isa)), isa
        on_dequantized = panel(x, dequantized, b, isa)
        if scale_times_code_exact:
            assert torch.equal(got, on_dequantized), isa
        else:
            # float32 scales: ``dequantize`` rounds ``scale * code`` before adding the
            # offset, the kernel's FMA does not, so a weight may differ by an ulp and the
            # outputs by the bound's share of it; bit for bit on the FMA's weights above.
            assert_close(got, on_dequantized.double(), 2 * bound, f"{isa} vs dequantize()")


def test_the_fma_emulation_rounds_once():
    """``fma_float32``'s corner: ``c * s + o`` whose float64 sum lies halfway between two
    float32 values while the exact value does not (the product carries a bit below the
    sum's last float64 place): rounded by the error's sign, where rounding the float64
    sum again would take the even neighbour."""
    # c * s = (2**30 + 1) * 2**-54 = 2**-24 + 2**-54; 1 + that rounds in float64 to
    # 1 + 2**-24, the midpoint of 1 and 1 + 2**-23: the FMA gives 1 + 2**-23.
    c, s = np.float32(5 * 5 * 13 * 41), np.float32(61 * 1321 * 2.0**-54)
    assert float(c) * float(s) == 2.0**-24 + 2.0**-54
    got = fma_float32(np.array([c]), np.array([s]), np.array([np.float32(1)]))
    assert got[0] == np.float32(1 + 2.0**-23)
    # (2**30 - 1) * 2**-54 = 2**-24 - 2**-54 on 1 + 2**-23: the float64 sum is the
    # midpoint of 1 + 2**-23 and 1 + 2**-22 (even), the exact value below it.
    c, s = np.float32(7 * 31 * 151), np.float32(3 * 3 * 11 * 331 * 2.0**-54)
    assert float(c) * float(s) == 2.0**-24 - 2.0**-54
    got = fma_float32(np.array([c]), np.array([s]), np.array([np.float32(1 + 2.0**-23)]))
    assert got[0] == np.float32(1 + 2.0**-23)
    # no tie: the float64 sum rounded to float32
    assert fma_float32(np.array([np.float32(3)]), np.array([np.float32(0.5)]), np.array([np.float32(0.25)]))[0] == 1.75


# -- 2. a row's result does not depend on its batch ----------------------------------------------


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_a_row_does_not_depend_on_the_rows_beside_it(isa, bits, group):
    """Each row alone (M = 1: AVX-512's four-panel pass) equals the same row in batches
    of every size 2 to 20, its neighbours random rows: the row blocks (AVX-512: 4 panels
    at M <= 2, else 2 panels and 8 rows; AVX2: 4 rows) and the panel count (5: a short
    last unit) change, the FMA chain of each output does not. On one thread and on the
    process's count (the fast tier's xdist workers run one each: a second team of
    threads per worker would oversubscribe the cores)."""
    gen = torch.Generator().manual_seed(bits)
    w = random_weight(gen, 80, 320, bits, group, scales="float32", offsets="float32")
    b = torch.randn(80, generator=gen)
    layer = QuantPanelLinear(w, b, OPS)
    x = torch.randn(20, 320, generator=gen)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            alone = torch.cat([quant(layer, x[r : r + 1].contiguous(), isa) for r in range(20)])
            for m in range(2, 21):
                pick = torch.randperm(20, generator=gen)[:m]
                batch = quant(layer, x[pick].contiguous(), isa)
                for i, r in enumerate(pick.tolist()):
                    assert torch.equal(batch[i], alone[r]), (t, m, r)
    finally:
        torch.set_num_threads(threads)


# -- 3. the library path, the torch path, what is refused ------------------------------------


class Spy:
    """The kernels, recording which of them a layer calls."""

    def __init__(self, ops) -> None:
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        fn = getattr(self.ops, name)

        def call(*args):
            self.calls.append((name, args[-2:] if name == "dequantize_quant_panels" else ()))
            return fn(*args)

        return call


@needs_kernels
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_calls_of_gemm_from_rows_rows_take_the_library_gemm(monkeypatch, bits, bias):
    """Below ``gemm_from_rows`` rows the kernel runs (its result); at or above it the
    library GEMM, on dequantized slices of panels (here two panels a slice: 2 + 2 + 1),
    close to the exact product."""
    gen = torch.Generator().manual_seed(bits)
    k = 128
    w = random_weight(gen, 80, k, bits, 32, scales="float32", offsets="zero_point")
    b = torch.randn(80, generator=gen) if bias else None
    monkeypatch.setattr(quant_linear_module, "SLICE_ELEMENTS", 2 * 16 * k)
    spy = Spy(OPS)
    layer = QuantPanelLinear(w, b, spy, gemm_from_rows=8)
    w64 = exact_weights(w)
    for rows in (1, 7, 8, 9, 33, 100):
        x = torch.randn(rows, k, generator=gen)
        spy.calls.clear()
        got = layer.matmul(x)
        assert got.shape == (rows, 80)
        assert_close(got, *reference(x, w64, b), f"{rows} rows")
        if rows < 8:
            assert [name for name, _ in spy.calls] == ["quant_linear"]
            kernel = torch.empty(rows, 80)
            OPS.quant_linear(kernel, x, layer.codes, layer.groups, layer.bias, 32)
            assert torch.equal(got, kernel)
        else:
            assert spy.calls == [("dequantize_quant_panels", (0, 2)), ("dequantize_quant_panels", (2, 4)),
                                 ("dequantize_quant_panels", (4, 5))], rows
    # forward: any leading dimensions, the input's dtype back
    x = torch.randn(2, 5, k, generator=gen)
    assert torch.equal(layer(x), layer.matmul(x.reshape(10, k)).view(2, 5, 80))
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("bits,n,k,group", [(4, 72, 96, 32), (8, 80, 64, 16), (5, 8, 256, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_torch_path_is_f_linear_on_the_dequantized_weight(monkeypatch, bits, n, k, group, bias):
    """``QuantizedLinear.forward`` (any output count, slices of 24 outputs here) is the
    float product of the dequantized weight, over any leading dimensions."""
    gen = torch.Generator().manual_seed(n)
    w = random_weight(gen, n, k, bits, group)
    b = torch.randn(n, generator=gen) if bias else None
    monkeypatch.setattr(torch_linear_module, "SLICE_ELEMENTS", 24 * k)
    layer = QuantizedLinear(w, b)
    x = torch.randn(3, 4, k, generator=gen)
    got = layer(x)
    assert got.shape == (3, 4, n)
    dequantized = w.dequantize()
    want, bound = reference(x.reshape(12, k), exact_weights(w), b)
    assert_close(got.reshape(12, n), want, bound, "QuantizedLinear")
    assert_close(got.reshape(12, n), F.linear(x, dequantized, b).reshape(12, n).double(), 2 * bound, "F.linear")
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@needs_kernels
def test_what_the_kernel_cannot_run_is_refused():
    gen = torch.Generator().manual_seed(0)
    four = random_weight(gen, 32, 64, 4, 16)
    eight = random_weight(gen, 32, 64, 8, 16)
    assert QuantPanelLinear.applies(four, OPS) and QuantPanelLinear.applies(eight, OPS)
    for bits in (4, 8):
        assert not QuantPanelLinear.applies(random_weight(gen, 24, 64, bits, 16), OPS)  # N not a multiple of 16
    assert not QuantPanelLinear.applies(four, None)
    odd_groups = QuantizedWeight.from_codes(torch.zeros(16, 6, dtype=torch.uint8), torch.ones(16, 2),
                                            torch.zeros(16, 2), 4, 3, "odd groups")
    assert not QuantPanelLinear.applies(odd_groups, OPS)  # packed codes in groups of an odd size
    with pytest.raises(RuntimeError, match="pack_quant_panels.*multiple of 16"):
        OPS.pack_quant_panels(torch.zeros(24, 8, dtype=torch.uint8))

    layer = QuantPanelLinear(four, None, OPS)
    x = torch.randn(3, 64)
    y = torch.empty(3, 32)
    with pytest.raises(RuntimeError, match="quant_linear: codes must be"):
        layer.matmul(torch.randn(3, 80))  # codes for 64 inputs, rows of 80
    with pytest.raises(RuntimeError, match="quant_linear: codes must be"):
        OPS.quant_linear(y, x, layer.codes[:, :, :8].contiguous(), layer.groups, None, 16)
    with pytest.raises(RuntimeError, match="quant_linear: groups must be"):
        OPS.quant_linear(y, x, layer.codes, layer.groups[:, :2].contiguous(), None, 16)
    with pytest.raises(RuntimeError, match="quant_linear: K .* whole groups"):
        OPS.quant_linear(y, x, layer.codes, layer.groups, None, 48)
    with pytest.raises(RuntimeError, match="quant_linear: 4-bit codes need even groups"):
        # K = 6 in groups of 3: codes [1, 3, 16], groups [1, 2, 32]
        OPS.quant_linear(torch.empty(3, 16), torch.randn(3, 6), torch.zeros(1, 3, 16, dtype=torch.uint8),
                         torch.zeros(1, 2, 32), None, 3)
    with pytest.raises(RuntimeError, match="quant_linear: y must be"):
        OPS.quant_linear(torch.empty(3, 16), x, layer.codes, layer.groups, None, 16)
    with pytest.raises(RuntimeError, match="quant_linear: x must be a contiguous"):
        OPS.quant_linear(y, torch.randn(64, 3).t(), layer.codes, layer.groups, None, 16)
    with pytest.raises(RuntimeError, match="quant_linear: bias must have N entries"):
        OPS.quant_linear(y, x, layer.codes, layer.groups, torch.zeros(16), 16)
    with pytest.raises(RuntimeError, match="quant_linear: this CPU has no neon"):
        OPS.quant_linear(y, x, layer.codes, layer.groups, None, 16, "neon")
    # the unpacking entry points check the panels as the product does (no read past them)
    big_codes = torch.zeros(64, 32, 16, dtype=torch.uint8)  # 64 panels, one panel of groups
    for call in (lambda c, g, size: OPS.dequantize_quant_panels(c, g, size, 0, 1),
                 lambda c, g, size: OPS.quant_panel_rows(c, g, size, torch.tensor([0]))):
        with pytest.raises(RuntimeError, match="codes must be .* and groups"):
            call(big_codes, layer.groups, 16)
        with pytest.raises(RuntimeError, match="codes must be .* and groups"):
            call(layer.codes[:, :, :8].contiguous(), layer.groups, 16)
        with pytest.raises(RuntimeError, match="group_size must be positive"):
            call(layer.codes, layer.groups, 0)


# -- 4. the swap ----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, proj: nn.Module, shared: nn.Module, odd: nn.Module) -> None:
        super().__init__()
        self.proj, self.shared, self.odd = proj, shared, odd
        self.plain = nn.Linear(32, 16)


class Tiny(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()

        def quantized(n: int, bits: int) -> QuantizedLinear:
            return QuantizedLinear(random_weight(gen, n, 32, bits, 16), torch.randn(n, generator=gen))

        shared = quantized(32, 8)
        self.blocks = nn.ModuleList([Block(quantized(48, 4), shared, quantized(24, 4)) for _ in range(2)])
        self.head = quantized(64, 4)

    def get_output_embeddings(self) -> nn.Module:
        return self.head


@needs_kernels
def test_quantize_linear_layers_swaps_what_the_kernel_runs():
    """Each QuantizedLinear the kernel applies to becomes a QuantPanelLinear of the same
    weight (a shared one once, still shared); 24 outputs and ``nn.Linear`` stay; the
    output embedding keeps the kernel at every size; the results stay the torch path's."""
    model = Tiny(torch.Generator().manual_seed(1))
    before = {name: m for name, m in model.named_modules()}
    x = torch.randn(5, 32)
    want = {name: m(x) for name, m in before.items() if isinstance(m, QuantizedLinear | nn.Linear)}
    assert quantize_linear_layers(model, None) == 0 and isinstance(model.head, QuantizedLinear)
    assert quantize_linear_layers(model, OPS, gemm_from_rows=4) == 4  # 2 proj, shared, head
    b0, b1 = model.blocks
    assert b0.shared is b1.shared and isinstance(b0.shared, QuantPanelLinear)
    assert b0.shared.format == before["blocks.0.shared"].quantized.format
    for name in ("blocks.0.proj", "blocks.1.proj", "blocks.0.shared", "head"):
        swapped = model.get_submodule(name)
        assert isinstance(swapped, QuantPanelLinear), name
        assert swapped.gemm_from_rows == (0 if name == "head" else GEMM_FROM_ROWS), name  # the quantized threshold
        assert swapped.format == before[name].quantized.format and not hasattr(swapped, "quantized")
        w = before[name].quantized
        assert_close(swapped(x), *reference(x, exact_weights(w), before[name].bias.detach()), name)
        assert torch.allclose(swapped(x), want[name], rtol=1e-5, atol=1e-5), name
    for name in ("blocks.0.odd", "blocks.1.odd", "blocks.0.plain", "blocks.1.plain"):
        assert model.get_submodule(name) is before[name], name
    assert quantize_linear_layers(model, OPS) == 0  # nothing left to swap


@needs_kernels
@settings(max_examples=examples(40), deadline=None)
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([16, 32]), panels=st.integers(1, 4),
       seed=st.integers(0, 2**31), scales=st.sampled_from(["fp16", "float32"]))
def test_a_tied_embedding_reads_the_rows_of_the_output_panels(bits, group, panels, seed, scales):
    """``QuantPanelEmbedding`` looks rows up in the output layer's panels: the rows
    ``dequantize`` gives (rounded once either way), in the order asked, repeats included."""
    from worker.cpu.quant_linear import QuantPanelEmbedding

    gen = torch.Generator().manual_seed(seed)
    w = random_weight(gen, 16 * panels, 64, bits, group, scales)
    table = QuantPanelEmbedding(QuantPanelLinear(w, None, OPS))
    ids = torch.randint(0, 16 * panels, (3, 5), generator=gen)
    ids[0, 0] = ids[2, 4]  # a repeat
    got = table(ids)
    assert got.shape == (3, 5, 64)
    torch.testing.assert_close(got.reshape(15, 64), kernel_weights(w)[ids.reshape(-1)], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="outside the"):
        table(torch.tensor([16 * panels]))


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_both_avx512_paths_give_the_same_bits(bits):
    """Dequantized in registers (few rows) or into a float buffer for the float panel
    kernel's blocks (many rows): the same values summed in the same order."""
    if "avx512" not in OPS.quant_isas():
        pytest.skip("no AVX-512 here")
    gen = torch.Generator().manual_seed(7)
    w = random_weight(gen, 48, 128, bits, 32)
    layer = QuantPanelLinear(w, torch.randn(48, generator=gen), OPS)
    for rows in (1, 3, 13, 40):
        x = torch.randn(rows, 128, generator=gen)
        outs = []
        for dequant_rows in (1, 10**9):  # every call the buffer's path; every call in registers
            y = torch.empty(rows, 48)
            OPS.quant_linear(y, x, layer.codes, layer.groups, layer.bias, 32, "avx512", dequant_rows)
            outs.append(y)
        assert torch.equal(outs[0], outs[1]), rows
