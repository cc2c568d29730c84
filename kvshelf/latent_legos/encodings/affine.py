"""Affine family encoding over MLX's own ``mx.quantize`` / ``mx.dequantize`` (mode "affine").

The latent state is float32, so scales and biases stay float32: three planes ``[packed uint32, scales, biases]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...errors import InvalidCacheState
from ..formats import AFFINE_BITS, AFFINE_GROUP_SIZES


@dataclass(frozen=True, slots=True)
class AffineEncoding:
    """One family of ``width`` f32 values per position, quantized in groups of ``group_size`` at ``bits``."""

    bits: int
    group_size: int
    width: int
    planes: int = 3

    def __post_init__(self) -> None:
        if self.bits not in AFFINE_BITS:
            raise InvalidCacheState(f"affine bits must be one of {AFFINE_BITS} (got {self.bits!r})")
        if self.group_size not in AFFINE_GROUP_SIZES:
            raise InvalidCacheState(f"affine group size must be one of {AFFINE_GROUP_SIZES} (got {self.group_size!r})")
        if self.width <= 0 or self.width % self.group_size:
            raise InvalidCacheState(
                f"latent state width {self.width} is not a multiple of the affine group size {self.group_size}"
            )

    def plane_widths(self) -> tuple[int, int, int]:
        """Last-axis widths of the three planes."""
        groups = self.width // self.group_size
        return (self.width * self.bits // 32, groups, groups)

    def plane_dtypes(self) -> tuple[mx.Dtype, mx.Dtype, mx.Dtype]:
        return (mx.uint32, mx.float32, mx.float32)

    def encode(self, x: mx.array) -> list[mx.array]:
        _check_input(x, self.width)
        if x.shape[1] == 0:
            return _empty_planes(x.shape[0], self.plane_widths(), self.plane_dtypes())
        packed, scales, biases = mx.quantize(x.astype(mx.float32), group_size=self.group_size, bits=self.bits)
        return [packed, scales, biases]

    def decode(self, planes: list[mx.array]) -> mx.array:
        packed, scales, biases = _check_planes(planes, self.plane_widths(), self.plane_dtypes())
        if packed.shape[1] == 0:
            return mx.zeros((packed.shape[0], 0, self.width), dtype=mx.float32)
        if 8 % self.bits:
            return mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self.bits)
        return dequantize_elementwise(packed, scales, biases, self.group_size, self.bits)


def dequantize_elementwise(
    packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """``mx.dequantize`` for codes of 2, 4 or 8 bits as plain elementwise ops, the same bits (``q * scale + bias``
    per group, codes little-endian in the bytes of mlx's uint32 words).

    mlx's own ``dequantize`` on the CPU briefly holds twice its float32 output; this holds the output once (each
    op's input is dropped as the next one reads it) beside the codes widened to bytes, which a decode step of the
    history (the RoPE key mlx-lm multiplies itself) otherwise pays at every step."""
    lead, words = packed.shape[:-1], packed.shape[-1]
    width = words * 32 // bits
    codes = packed.view(mx.uint8)
    if bits != 8:
        shifts = mx.arange(0, 8, bits, dtype=mx.uint8)
        codes = (mx.expand_dims(codes, -1) >> shifts) & mx.array((1 << bits) - 1, dtype=mx.uint8)
    groups = codes.reshape(*lead, width // group_size, group_size).astype(mx.float32)
    return (groups * mx.expand_dims(scales, -1) + mx.expand_dims(biases, -1)).reshape(*lead, width)


def _check_input(x: mx.array, width: int) -> None:
    if x.ndim != 3 or x.shape[2] != width:
        raise InvalidCacheState(f"family values must be [B, L, {width}] (got {list(x.shape)})")


def _empty_planes(batch: int, widths: tuple[int, ...], dtypes: tuple[mx.Dtype, ...]) -> list[mx.array]:
    return [mx.zeros((batch, 0, w), dtype=d) for w, d in zip(widths, dtypes)]


def _check_planes(planes: list[mx.array], widths: tuple[int, ...], dtypes: tuple[mx.Dtype, ...]) -> list[mx.array]:
    """The planes, after checking count, rank, shared [B, L] and per-plane width and dtype."""
    if len(planes) != len(widths):
        raise InvalidCacheState(f"expected {len(widths)} planes, got {len(planes)}")
    lead = tuple(planes[0].shape[:2]) if planes[0].ndim == 3 else None
    for i, (plane, width, dtype) in enumerate(zip(planes, widths, dtypes)):
        if plane.ndim != 3 or tuple(plane.shape[:2]) != lead or plane.shape[2] != width or plane.dtype != dtype:
            raise InvalidCacheState(
                f"plane {i} is {list(plane.shape)} {plane.dtype}; expected [B, L, {width}] {dtype} with shared [B, L]"
            )
    return list(planes)
