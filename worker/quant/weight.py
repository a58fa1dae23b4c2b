"""QuantizedWeight: a linear layer's weight kept quantized, in the one form every
format is read into.

A weight ``W [out_features, in_features]`` is stored as unsigned integer codes and,
per group of ``group_size`` consecutive inputs of an output row, a float32 scale and
offset::

    W[n, k] = scales[n, k // g] * codes[n, k] + offsets[n, k // g]

That form holds every format raydecode reads: GGUF's blocks (``Q4_0``: scale ``d``,
offset ``-8 d``; ``Q4_1``: ``d`` and its minimum ``m``; the K-quants: the super-block's
scale times the sub-block's, and minus its minimum), a zero-point scheme (offset
``-zero_point * scale``) and a symmetric one (codes shifted to unsigned, the shift in
the offset). Codes of 4 bits are stored two to a byte (input ``2j`` in the low nibble,
``2j + 1`` in the high one); wider codes (GGUF's 5- and 6-bit ones, 8-bit ones) one to a
byte.

The value of a weight is ``scale * code + offset`` rounded once to float32, which is
what a fused multiply-add computes and what the CPU kernel does in registers. Every
format is read so that ``scale * code`` is exact in float32 (the scales carry few
enough significant bits: GGUF's are half-precision products of small integers,
on-the-fly quantization rounds its scales to half precision), so the product and the
sum rounded apart give the same value: ``dequantize`` is exact, and equal to the
format's own dequantizer (the ``gguf`` package's, for GGUF).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [N, K // 2] (bits 4) or [N, K] (bits 5 to 8)
    scales: torch.Tensor  # float32 [N, K // group_size]
    offsets: torch.Tensor  # float32 [N, K // group_size]
    bits: int  # bits of information in a code (4 to 8); 4-bit codes are packed two to a byte
    group_size: int  # inputs sharing a scale and offset
    in_features: int
    #: where it came from, for messages and the load report: "gguf Q4_1", "int4 g128 asym", ...
    format: str

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.bits not in range(4, 9):
            raise ValueError(f"{self.format}: codes of {self.bits} bits (4 to 8 are stored)")
        if g < 1 or k % g:
            raise ValueError(f"{self.format}: {k} inputs do not divide into groups of {g}")
        if self.packed and k % 2:
            raise ValueError(f"{self.format}: 4-bit codes need an even number of inputs, got {k}")
        width = k // 2 if self.packed else k
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (n, width):
            raise ValueError(f"{self.format}: codes must be uint8 [{n}, {width}], got {self.codes.dtype} "
                             f"{list(self.codes.shape)}")
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t.dtype != torch.float32 or tuple(t.shape) != (n, k // g):
                raise ValueError(f"{self.format}: {name} must be float32 [{n}, {k // g}], got {t.dtype} {list(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{self.format}: its {name} hold NaN or infinite values")

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def packed(self) -> bool:
        """Two codes to a byte."""
        return self.bits == 4

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                   group_size: int, format: str) -> QuantizedWeight:
        """From unpacked codes ``[N, K]`` (one per byte), packed here when 4-bit."""
        codes = codes.to(torch.uint8)
        k = int(codes.shape[1])
        if bits == 4:
            if k % 2:
                raise ValueError(f"{format}: 4-bit codes need an even number of inputs, got {k}")
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        return cls(codes.contiguous(), scales.float().contiguous(), offsets.float().contiguous(), bits, group_size,
                   k, format)

    def unpacked_codes(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """The codes of output rows ``rows`` as ``uint8 [n, K]``, one per byte."""
        codes = self.codes[rows]
        if not self.packed:
            return codes
        out = torch.empty(codes.shape[0], self.in_features, dtype=torch.uint8)
        out[:, 0::2] = codes & 0x0F
        out[:, 1::2] = codes >> 4
        return out

    def dequantize(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """``W[rows]`` in float32: ``scale * code + offset`` rounded once, as the kernel's
        fused multiply-add rounds it. Where ``scale * code`` is exact in float32 (every
        format read here but a checkpoint's full-precision scales) float32 arithmetic
        gives that; the rest goes through float64, where the product is exact."""
        g = self.group_size
        dtype = torch.float32 if self.exact_in_float32 else torch.float64
        codes = self.unpacked_codes(rows).to(dtype)
        scales = self.scales[rows].to(dtype).repeat_interleave(g, dim=1)
        offsets = self.offsets[rows].to(dtype).repeat_interleave(g, dim=1)
        return codes.mul_(scales).add_(offsets).float()

    @functools.cached_property
    def exact_in_float32(self) -> bool:
        """Whether every scale carries at most 24 - ``bits`` significant bits (then
        ``scale * code`` is exact in float32)."""
        mantissa = self.scales.view(torch.int32) & 0x7FFFFF
        return bool(((mantissa & ((1 << self.bits) - 1)) == 0).all())

    def output_rows(self, start: int, stop: int) -> QuantizedWeight:
        """Outputs ``[start, stop)`` (a tensor-parallel shard of a column-parallel layer,
        one projection of a merged one)."""
        return replace(self, codes=self.codes[start:stop].contiguous(), scales=self.scales[start:stop].contiguous(),
                       offsets=self.offsets[start:stop].contiguous())

    def input_columns(self, start: int, stop: int) -> QuantizedWeight:
        """Inputs ``[start, stop)`` (a row-parallel layer's shard); the bounds must fall on
        group boundaries (and on bytes for packed codes)."""
        g = self.group_size
        if start % g or stop % g:
            raise ValueError(f"{self.format}: inputs [{start}, {stop}) cut groups of {g}")
        per_byte = 2 if self.packed else 1
        if start % per_byte or stop % per_byte:
            raise ValueError(f"{self.format}: inputs [{start}, {stop}) cut bytes of packed 4-bit codes")
        return replace(self, codes=self.codes[:, start // per_byte : stop // per_byte].contiguous(),
                       scales=self.scales[:, start // g : stop // g].contiguous(),
                       offsets=self.offsets[:, start // g : stop // g].contiguous(), in_features=stop - start)


def stack_outputs(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose outputs are ``parts``' in order (a layer's q, k and v merged):
    the parts must share their inputs, code width and groups."""
    first = parts[0]
    for p in parts[1:]:
        if (p.in_features, p.bits, p.group_size) != (first.in_features, first.bits, first.group_size):
            raise ValueError(f"cannot stack {p.format} ({p.in_features} inputs, {p.bits}-bit codes, groups of "
                             f"{p.group_size}) under {first.format} ({first.in_features}, {first.bits}, "
                             f"{first.group_size})")
    formats = sorted({p.format for p in parts})
    return replace(first, codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
                   offsets=torch.cat([p.offsets for p in parts]), format=" + ".join(formats))


def can_stack(parts: list[QuantizedWeight]) -> bool:
    first = parts[0]
    return all((p.in_features, p.bits, p.group_size) == (first.in_features, first.bits, first.group_size)
               for p in parts)
