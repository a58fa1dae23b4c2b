"""GGUF's quantized blocks read into ``QuantizedWeight``'s form, block layouts as
llama.cpp's ``ggml-quants`` (and the ``gguf`` package's dequantizer) define them.

Each reader takes a tensor's raw bytes ``[rows, blocks * block_bytes]`` (one row per
output feature) and returns its codes, one per byte, with the scale and offset of each
group, so that ``scale * code + offset`` is the ``gguf`` package's dequantized value
(tested against it). The 4-bit types keep 4-bit codes; the 5-, 6- and 8-bit ones keep a
byte per code (a wider kernel layout than the file's, the same values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from worker.quant.weight import QuantizedWeight

QK_K = 256  # a K-quant's super-block


@dataclass(frozen=True)
class Unpacked:
    codes: np.ndarray  # uint8 [rows, K]
    scales: np.ndarray  # float32 [rows, K // group]
    offsets: np.ndarray  # float32 [rows, K // group]
    bits: int
    group: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian half floats in the last axis's byte pairs, as float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = raw.shape[0]
    if raw.shape[1] % block_bytes:
        raise ValueError(f"a row of {raw.shape[1]} bytes is not whole blocks of {block_bytes}")
    return raw.reshape(rows, -1, block_bytes)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: the low nibbles first, then the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """``[..., 4]`` bytes (a little-endian 32-bit mask) -> ``[..., 32]`` bits."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def q4_0(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 18)
    d = _f16(b[..., 0:2])  # [rows, blocks, 1]
    codes = _nibbles_32(b[..., 2:18])
    return Unpacked(codes.reshape(b.shape[0], -1), d[..., 0], -8 * d[..., 0], 4, 32)


def q4_1(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    codes = _nibbles_32(b[..., 4:20])
    return Unpacked(codes.reshape(b.shape[0], -1), d[..., 0], m[..., 0], 4, 32)


def q5_0(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 22)
    d = _f16(b[..., 0:2])
    codes = _nibbles_32(b[..., 6:22]) | (_high_bits_32(b[..., 2:6]) << 4)
    return Unpacked(codes.reshape(b.shape[0], -1), d[..., 0], -16 * d[..., 0], 5, 32)


def q5_1(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 24)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    codes = _nibbles_32(b[..., 8:24]) | (_high_bits_32(b[..., 4:8]) << 4)
    return Unpacked(codes.reshape(b.shape[0], -1), d[..., 0], m[..., 0], 5, 32)


def q8_0(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 34)
    d = _f16(b[..., 0:2])
    codes = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Unpacked(codes.reshape(b.shape[0], -1), d[..., 0], -128 * d[..., 0], 8, 32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K / Q5_K super-block's 12 bytes -> its 8 sub-blocks' 6-bit scales and mins."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """A K-quant's 128 bytes of nibbles -> 256 codes: each run of 32 bytes holds a
    sub-block of 32 in its low nibbles and the next one in its high nibbles."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([q & 0x0F, q >> 4], axis=-2).reshape(*qs.shape[:-1], QK_K)


def q4_k(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scale_min(b[..., 4:16])
    codes = _k_nibbles(b[..., 16:144])
    rows = b.shape[0]
    return Unpacked(codes.reshape(rows, -1), (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1), 4, 32)


def q5_k(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 176)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scale_min(b[..., 4:16])
    qh = b[..., 16:48]  # bit j of byte i: the high bit of code 32 j + i
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*qh.shape[:-1], QK_K)
    codes = _k_nibbles(b[..., 48:176]) | (high << 4)
    rows = b.shape[0]
    return Unpacked(codes.reshape(rows, -1), (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1), 5, 32)


def q6_k(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 210)
    ql, qh, scales, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    # Two halves of 128 codes; in each, 64 bytes of nibbles (two runs of 32 in the low
    # nibbles, two in the high) and 32 bytes of 2-bit high parts (four runs of 32).
    low = ql.reshape(*ql.shape[:-1], 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(*ql.shape[:-1], 2, 4, 32)
    high = qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    high = (high & 0x03).reshape(*qh.shape[:-1], 2, 4, 32)
    codes = (low | (high << 4)).reshape(*ql.shape[:-1], QK_K)
    scale = d * scales.view(np.int8).astype(np.float32)  # [rows, blocks, 16]
    rows = b.shape[0]
    return Unpacked(codes.reshape(rows, -1), scale.reshape(rows, -1), (-32 * scale).reshape(rows, -1), 6, 16)


#: GGUF quantization type name -> its reader
READERS: dict[str, Callable[[np.ndarray], Unpacked]] = {
    "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q8_0": q8_0,
    "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
}
#: float types GGUF stores as they are
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}


def quantized_weight(raw: np.ndarray, type_name: str) -> QuantizedWeight:
    """A GGUF tensor of a quantized type (raw bytes ``[rows, row bytes]``) as a
    ``QuantizedWeight``; ``ValueError`` naming the type where it has no reader."""
    reader = READERS.get(type_name)
    if reader is None:
        raise ValueError(f"GGUF quantization type {type_name} is not supported (supported: {', '.join(READERS)})")
    u = reader(np.ascontiguousarray(raw, dtype=np.uint8))
    return QuantizedWeight.from_codes(torch.from_numpy(u.codes), torch.from_numpy(np.ascontiguousarray(u.scales)),
                                      torch.from_numpy(np.ascontiguousarray(u.offsets)), u.bits, u.group,
                                      f"gguf {type_name}")
