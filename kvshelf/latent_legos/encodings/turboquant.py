"""TurboQuant, ported from its reference behaviour (bit-exact goldens matter, so the arithmetic order is kept).

Groups of ``BLOCK`` = 32 run along the last axis only.

* Keys: asymmetric affine per group, no rotation; signed int8 codes at 8 bits, unsigned codes below (bit-packed by
  the caller with :func:`pack_bits`). Scales and zeros are stored as float16.
* Values: a fixed sign flip and a normalised Walsh–Hadamard rotation make every coordinate roughly unit-normal, so
  a per-group RMS scale and a Lloyd–Max codebook for N(0, 1) fit them; codes are uint8 (unpacked).
"""

from __future__ import annotations

import mlx.core as mx

from ...errors import InvalidCacheState
from .tables import lloyd_max

BLOCK = 32
EPS = 1e-8
PACK_BITS = (2, 3, 4, 5, 8)
KEY_BITS = (2, 3, 4, 5, 8)


def _check_bits(bits: int, allowed: tuple[int, ...], what: str) -> None:
    if isinstance(bits, bool) or bits not in allowed:
        raise InvalidCacheState(f"{what} bits must be one of {allowed} (got {bits!r})")


def packed_dim(width: int, bits: int) -> int:
    """Bytes one row of ``width`` codes packs into; the row must fill whole bytes."""
    _check_bits(bits, PACK_BITS, "packed code")
    if (width * bits) % 8:
        raise InvalidCacheState(f"{width} codes of {bits} bits do not fill whole bytes (width*bits must divide by 8)")
    return width * bits // 8


def pack_bits(values: mx.array, bits: int) -> mx.array:
    """Pack uint8 codes ``[..., D]`` into a little-endian bit stream ``[..., D*bits/8]`` uint8.

    Code ``i`` occupies stream bits ``[i*bits, (i+1)*bits)``; bits above ``bits`` in a code are dropped.
    Eight bits is the identity.
    """
    if values.dtype != mx.uint8:
        raise InvalidCacheState(f"pack_bits takes uint8 codes (got {values.dtype})")
    if values.ndim == 0:
        raise InvalidCacheState("pack_bits needs at least one axis")
    width = values.shape[-1]
    nbytes = packed_dim(width, bits)
    if bits == 8:
        return values
    lead = values.shape[:-1]
    # Spread every code into its bits, regroup the flat stream in eights, and weigh each eight back into a byte.
    shifts = mx.arange(bits, dtype=mx.uint8)
    stream = (mx.expand_dims(values, -1) >> shifts) & 1
    stream = stream.reshape(*lead, nbytes, 8)
    weights = mx.arange(8, dtype=mx.uint8)
    return mx.sum(stream << weights, axis=-1).astype(mx.uint8)


def unpack_bits(packed: mx.array, bits: int, width: int) -> mx.array:
    """Exact inverse of :func:`pack_bits`: ``[..., width*bits/8]`` uint8 back to ``[..., width]`` uint8 codes."""
    if packed.dtype != mx.uint8:
        raise InvalidCacheState(f"unpack_bits takes uint8 bytes (got {packed.dtype})")
    if packed.ndim == 0:
        raise InvalidCacheState("unpack_bits needs at least one axis")
    nbytes = packed_dim(width, bits)
    if packed.shape[-1] != nbytes:
        raise InvalidCacheState(
            f"packed rows hold {packed.shape[-1]} bytes; {width} codes of {bits} bits need {nbytes}"
        )
    if bits == 8:
        return packed
    lead = packed.shape[:-1]
    if 8 % bits == 0:  # whole codes per byte (1, 2, 4 bits): code i of a byte sits at bits [i*b, (i+1)*b), the
        # stream order below, read with one shift and mask per code instead of a byte per stream bit
        shifts = mx.arange(0, 8, bits, dtype=mx.uint8)
        codes = (mx.expand_dims(packed, -1) >> shifts) & mx.array((1 << bits) - 1, dtype=mx.uint8)
        return codes.reshape(*lead, width)
    stream = (mx.expand_dims(packed, -1) >> mx.arange(8, dtype=mx.uint8)) & 1
    stream = stream.reshape(*lead, width, bits)
    return mx.sum(stream << mx.arange(bits, dtype=mx.uint8), axis=-1).astype(mx.uint8)


def _groups(x: mx.array, what: str) -> mx.array:
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise InvalidCacheState(f"{what} width {x.shape[-1] if x.ndim else None} is not a multiple of {BLOCK}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def encode_keys(x: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Asymmetric affine codes per 32-group: ``(indices, scales f16, zeros f16)``.

    ``indices`` are int8 in [-127, 127] when ``bits == 8`` (signed), else uint8 in ``[0, 2**bits - 1]`` (not
    packed). Math runs in float32. A constant group has scale 0 and a zero of ``round(min / 1e-8)``, which
    overflows float16 to ±inf unless the constant is tiny — kept as the reference does.
    """
    _check_bits(bits, KEY_BITS, "TurboQuant key")
    g = _groups(x.astype(mx.float32), "key")
    lo = mx.min(g, axis=-1, keepdims=True)
    hi = mx.max(g, axis=-1, keepdims=True)
    if bits == 8:
        scale = (hi - lo) / (2 * 127)
        zero = mx.round((hi + lo) / (2 * (scale + EPS)))
        idx = mx.clip(mx.round(g / (scale + EPS) - zero), -127, 127).astype(mx.int8)
    else:
        top = 2**bits - 1
        scale = (hi - lo) / top
        zero = mx.round(lo / (scale + EPS))
        idx = mx.clip(mx.round(g / (scale + EPS) - zero), 0, top).astype(mx.uint8)
    return (
        idx.reshape(x.shape),
        scale.squeeze(-1).astype(mx.float16),
        zero.squeeze(-1).astype(mx.float16),
    )


def decode_keys(indices: mx.array, scales: mx.array, zeros: mx.array) -> mx.array:
    """``(float32(idx) + zero) * scale`` per group, as bfloat16 (unpacked ``indices``, int8 or uint8)."""
    g = _groups(indices, "key code")
    if scales.shape != g.shape[:-1] or zeros.shape != g.shape[:-1]:
        raise InvalidCacheState(
            f"key scales {scales.shape} / zeros {zeros.shape} do not match codes {indices.shape} (expected {g.shape[:-1]})"
        )
    s = mx.expand_dims(scales.astype(mx.float32), -1)
    z = mx.expand_dims(zeros.astype(mx.float32), -1)
    out = (g.astype(mx.float32) + z) * s
    return out.reshape(indices.shape).astype(mx.bfloat16)


def hadamard_signs(dim: int) -> mx.array:
    """The fixed ±1 float32 sign flip for a head dim (seeded with key 42, as the reference tables are)."""
    return (1 - 2 * mx.random.randint(0, 2, shape=(dim,), key=mx.random.key(42))).astype(mx.float32)


def rotate(x: mx.array) -> mx.array:
    """Sign flip then the normalised Walsh–Hadamard transform along the last axis (float32 out)."""
    flipped = x.astype(mx.float32) * hadamard_signs(x.shape[-1])
    if flipped.size == 0:
        return flipped
    return mx.hadamard_transform(flipped)


def unrotate(y: mx.array) -> mx.array:
    """Inverse of :func:`rotate` (the normalised transform is its own inverse)."""
    y = y.astype(mx.float32)
    if y.size == 0:
        return y
    return mx.hadamard_transform(y) * hadamard_signs(y.shape[-1])


def encode_values(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """Rotate, scale each 32-group to unit RMS, and code it with the Lloyd–Max table: ``(indices u8, scales f16)``."""
    centroids, boundaries = lloyd_max(bits)
    del centroids
    g = _groups(rotate(x), "value")
    scale = mx.sqrt(mx.mean(g * g, axis=-1, keepdims=True))
    normed = g / (scale + EPS)
    idx = mx.sum(mx.expand_dims(normed, -1) > boundaries, axis=-1).astype(mx.uint8)
    return idx.reshape(x.shape), scale.squeeze(-1).astype(mx.float16)


def decode_values(indices: mx.array, scales: mx.array, bits: int) -> mx.array:
    """``centroids[idx] * scale`` per group, un-rotated, as bfloat16."""
    centroids, _ = lloyd_max(bits)
    g = _groups(indices, "value code")
    if scales.shape != g.shape[:-1]:
        raise InvalidCacheState(f"value scales {scales.shape} do not match codes {indices.shape}")
    y = centroids[g.astype(mx.uint32)] * mx.expand_dims(scales.astype(mx.float32), -1)
    return unrotate(y.reshape(indices.shape)).astype(mx.bfloat16)
