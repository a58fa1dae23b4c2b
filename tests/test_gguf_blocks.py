"""GGUF's quantized blocks read into QuantizedWeight: the values equal the ``gguf``
package's own dequantizer bit for bit, for every type raydecode reads. Blocks come from
the package's quantizer where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and as random
bytes otherwise (any bit pattern is a valid K-quant block once its half-precision
scales are finite), so every code, scale and minimum is exercised."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize
from gguf.constants import GGML_QUANT_SIZES
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_budget import examples
from worker.quant.gguf_blocks import READERS, quantized_weight
from worker.quant.weight import QuantizedWeight, stack_outputs

QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
#: byte offsets of each K-quant block's half-precision scales
K_QUANT_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks ``[rows, blocks * block bytes]``: random bytes, with each
    half-precision scale set to a finite value."""
    qtype = GGMLQuantizationType[type_name]
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, blocks, block_bytes), dtype=np.uint8)
    for at in K_QUANT_HALVES[type_name]:
        halves = rng.uniform(-0.05, 0.05, size=(rows, blocks)).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def gguf_values(raw: np.ndarray, type_name: str) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)


@settings(max_examples=examples(60), deadline=None)
@given(type_name=st.sampled_from(QUANTIZABLE), rows=st.integers(1, 9), blocks=st.integers(1, 6),
       seed=st.integers(0, 2**31), spread=st.sampled_from([1e-3, 1.0, 300.0]))
def test_quantized_types_equal_the_gguf_dequantizer(type_name, rows, blocks, seed, spread):
    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    x = np.random.default_rng(seed).normal(0, spread, size=(rows, blocks * block)).astype(np.float32)
    raw = quantize(x, GGMLQuantizationType[type_name])
    w = quantized_weight(raw, type_name)
    assert (w.out_features, w.in_features) == (rows, blocks * block)
    np.testing.assert_array_equal(w.dequantize().numpy(), gguf_values(raw, type_name))


@settings(max_examples=examples(60), deadline=None)
@given(type_name=st.sampled_from(list(K_QUANT_HALVES)), rows=st.integers(1, 5), blocks=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_k_quants_equal_the_gguf_dequantizer(type_name, rows, blocks, seed):
    raw = random_blocks(type_name, rows, blocks, np.random.default_rng(seed))
    w = quantized_weight(raw, type_name)
    assert w.in_features == blocks * 256
    np.testing.assert_array_equal(w.dequantize().numpy(), gguf_values(raw, type_name))


def test_every_reader_keeps_the_codes_width():
    rng = np.random.default_rng(0)
    widths = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
    assert set(widths) == set(READERS)
    for name, bits in widths.items():
        block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        if name in K_QUANT_HALVES:
            raw = random_blocks(name, 2, 1, rng)
        else:
            raw = quantize(rng.normal(size=(2, block)).astype(np.float32), GGMLQuantizationType[name])
        w = quantized_weight(raw, name)
        assert w.bits == bits and w.packed == (bits == 4)
        assert int(w.unpacked_codes().max()) < 2**bits


def test_an_unsupported_type_is_named():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        quantized_weight(np.zeros((1, 66), dtype=np.uint8), "IQ2_XXS")


def test_a_truncated_row_is_refused():
    with pytest.raises(ValueError, match="not whole blocks of 20"):
        quantized_weight(np.zeros((1, 30), dtype=np.uint8), "Q4_1")


def test_slices_and_stacks_keep_the_values():
    rng = np.random.default_rng(1)
    raw = quantize(rng.normal(size=(48, 128)).astype(np.float32), GGMLQuantizationType.Q4_1)
    w = quantized_weight(raw, "Q4_1")
    full = w.dequantize()
    torch.testing.assert_close(w.output_rows(16, 40).dequantize(), full[16:40], rtol=0, atol=0)
    torch.testing.assert_close(w.input_columns(32, 96).dequantize(), full[:, 32:96], rtol=0, atol=0)
    stacked = stack_outputs([w.output_rows(0, 16), w.output_rows(16, 48)])
    torch.testing.assert_close(stacked.dequantize(), full, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cut groups of 32"):
        w.input_columns(0, 48)


def test_malformed_weights_are_refused_by_name():
    codes = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales must be float32"):
        QuantizedWeight(codes, torch.zeros(4, 2, dtype=torch.float16), torch.zeros(4, 1), 4, 32, 32, "test")
    with pytest.raises(ValueError, match="do not divide into groups"):
        QuantizedWeight(codes, torch.zeros(4, 1), torch.zeros(4, 1), 4, 24, 32, "test")
    with pytest.raises(ValueError, match="even number of inputs"):  # 4-bit codes two to a byte
        QuantizedWeight(torch.zeros(4, 1, dtype=torch.uint8), torch.zeros(4, 3), torch.zeros(4, 3), 4, 1, 3, "test")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="test: its scales hold NaN or infinite values"):
            QuantizedWeight(codes, torch.full((4, 1), bad), torch.zeros(4, 1), 4, 32, 32, "test")
        with pytest.raises(ValueError, match="test: its offsets hold NaN or infinite values"):
            QuantizedWeight(codes, torch.ones(4, 1), torch.full((4, 1), bad), 4, 32, 32, "test")
    odd = QuantizedWeight(torch.zeros(4, 6, dtype=torch.uint8), torch.ones(4, 4), torch.zeros(4, 4), 4, 3, 12, "odd")
    with pytest.raises(ValueError, match="cut bytes of packed 4-bit codes"):
        odd.input_columns(3, 9)
