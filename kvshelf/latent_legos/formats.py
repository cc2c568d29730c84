"""Storage formats a latent family can be encoded in (``None`` means plain float32)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidCacheState

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
TURBO_BITS = (2, 3, 4, 5, 8)


@dataclass(frozen=True, slots=True)
class AffineFormat:
    """MLX affine quantization (``mx.quantize``) at one bit width and group size for every family."""

    bits: int = 4
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in AFFINE_BITS:
            raise InvalidCacheState(f"affine bits must be one of {AFFINE_BITS} (got {self.bits!r})")
        if self.group_size not in AFFINE_GROUP_SIZES:
            raise InvalidCacheState(f"affine group_size must be one of {AFFINE_GROUP_SIZES} (got {self.group_size!r})")


@dataclass(frozen=True, slots=True)
class TurboFormat:
    """TurboQuant: latent families use the key encoding at ``k_bits``; ``v_bits`` is recorded (for K/V caches)."""

    k_bits: int = 8
    v_bits: int = 3

    def __post_init__(self) -> None:
        if self.k_bits not in TURBO_BITS:
            raise InvalidCacheState(f"TurboQuant k_bits must be one of {TURBO_BITS} (got {self.k_bits!r})")
        if self.v_bits not in TURBO_BITS:
            raise InvalidCacheState(f"TurboQuant v_bits must be one of {TURBO_BITS} (got {self.v_bits!r})")


LatentFormat = AffineFormat | TurboFormat


def format_key(fmt: LatentFormat | None) -> str:
    """The format's part of a signature: ``f32``, ``affine:<bits>:<group>`` or ``turbo:<k>:<v>``."""
    if fmt is None:
        return "f32"
    if isinstance(fmt, AffineFormat):
        return f"affine:{fmt.bits}:{fmt.group_size}"
    return f"turbo:{fmt.k_bits}:{fmt.v_bits}"
