"""How one family of latent state (the latent, the RoPE key, the DSA index key) is stored under a format.

Every encoding maps float32 positions ``[B, L, W]`` to planes ``[B, L, w_i]`` with positions on axis 1, so any
slice, concatenation or row take along axes 0/1 is byte-safe on every plane alike; decoding returns float32.
All-zero planes decode to zeros, which is what padding rows hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from ...errors import InvalidCacheState
from ..formats import AffineFormat, TurboFormat
from . import turboquant
from .affine import AffineEncoding, _check_input, _check_planes, _empty_planes


class FamilyEncoding(Protocol):
    planes: int

    def encode(self, x: mx.array) -> list[mx.array]: ...

    def decode(self, planes: list[mx.array]) -> mx.array: ...

    def plane_widths(self) -> tuple[int, ...]: ...

    def plane_dtypes(self) -> tuple[mx.Dtype, ...]: ...


@dataclass(frozen=True, slots=True)
class TurboKeyEncoding:
    """TurboQuant's key encoding at ``bits`` (signed iff 8; packed below 8), decoded through bfloat16 to float32.

    The latent feeds both keys and values, so it takes the key side's precision and its asymmetric affine code.
    """

    bits: int
    width: int
    planes: int = 3

    def __post_init__(self) -> None:
        if self.bits not in turboquant.KEY_BITS:
            raise InvalidCacheState(f"TurboQuant key bits must be one of {turboquant.KEY_BITS} (got {self.bits!r})")
        if self.width <= 0 or self.width % turboquant.BLOCK:
            raise InvalidCacheState(
                f"latent state width {self.width} has no TurboQuant key encoding (must be a multiple of {turboquant.BLOCK})"
            )

    def plane_widths(self) -> tuple[int, int, int]:
        groups = self.width // turboquant.BLOCK
        return (turboquant.packed_dim(self.width, self.bits), groups, groups)

    def plane_dtypes(self) -> tuple[mx.Dtype, mx.Dtype, mx.Dtype]:
        return (mx.int8 if self.bits == 8 else mx.uint8, mx.float16, mx.float16)

    def encode(self, x: mx.array) -> list[mx.array]:
        _check_input(x, self.width)
        if x.shape[1] == 0:
            return _empty_planes(x.shape[0], self.plane_widths(), self.plane_dtypes())
        indices, scales, zeros = turboquant.encode_keys(x, self.bits)
        if self.bits < 8:
            indices = turboquant.pack_bits(indices, self.bits)
        return [indices, scales, zeros]

    def decode(self, planes: list[mx.array]) -> mx.array:
        indices, scales, zeros = _check_planes(planes, self.plane_widths(), self.plane_dtypes())
        if indices.shape[1] == 0:
            return mx.zeros((indices.shape[0], 0, self.width), dtype=mx.float32)
        if self.bits < 8:
            indices = turboquant.unpack_bits(indices, self.bits, self.width)
        return turboquant.decode_keys(indices, scales, zeros).astype(mx.float32)


def family_encoding(fmt: AffineFormat | TurboFormat, width: int) -> FamilyEncoding:
    """The encoding of a family of ``width`` values under ``fmt`` (every family of a cache alike)."""
    if isinstance(fmt, AffineFormat):
        return AffineEncoding(fmt.bits, fmt.group_size, width)
    if isinstance(fmt, TurboFormat):
        return TurboKeyEncoding(fmt.k_bits, width)
    raise InvalidCacheState(f"no family encoding for format {fmt!r} (expected AffineFormat or TurboFormat)")
