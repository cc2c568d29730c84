"""Byte shuffling of float planes: the bytes of each element split into one stream per byte position.

Floating-point KV data compresses poorly as it lies (the mantissa bytes look random and sit between the
well-behaved sign/exponent bytes); grouping byte k of every element together gives zstd long runs of the
high, low-entropy bytes (baseline §4: bf16 KV-like 1.27x plain -> 1.46x shuffled). The transform is a pure
permutation, so the round trip is exact for any bytes, NaN payloads included.
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptData, InvalidCacheState


def _as_u8(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _transpose(data: bytes | bytearray | memoryview | np.ndarray, itemsize: int, unshuffling: bool) -> bytes:
    """The bytes as an element-by-byte matrix, transposed (what both directions do, with their own checks)."""
    raw = _as_u8(data)
    what = "unshuffle" if unshuffling else "shuffle"
    if itemsize < 1:
        raise InvalidCacheState(f"{what}: itemsize must be >= 1, got {itemsize}")
    if raw.size % itemsize:
        # A stored stream that does not split evenly is damage; caller-given elements that do not are misuse.
        error, unit = (CorruptData, "streams") if unshuffling else (InvalidCacheState, "elements")
        raise error(f"{what}: {raw.size} bytes is not a whole number of {itemsize}-byte {unit}")
    if itemsize == 1:
        return raw.tobytes()
    return (raw.reshape(itemsize, -1) if unshuffling else raw.reshape(-1, itemsize)).T.tobytes()


def shuffle(data: bytes | bytearray | memoryview | np.ndarray, itemsize: int) -> bytes:
    """Element bytes -> ``itemsize`` consecutive streams (stream k holds byte k of every element)."""
    return _transpose(data, itemsize, unshuffling=False)


def unshuffle(data: bytes | bytearray | memoryview | np.ndarray, itemsize: int) -> bytes:
    """Inverse of :func:`shuffle`: ``itemsize`` streams back to whole elements, byte for byte."""
    return _transpose(data, itemsize, unshuffling=True)


# Which dtypes are float planes worth shuffling (the integer planes of quantized formats are packed bits and
# gain nothing; see baseline §4 "c q4 g64 packed").
FLOAT_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def shuffle_itemsize(dtype: str) -> int:
    """The stream count to shuffle a plane of ``dtype`` with: its itemsize for floats, 1 (no shuffle) otherwise."""
    return FLOAT_ITEMSIZE.get(dtype, 1)


__all__ = ["shuffle", "unshuffle", "shuffle_itemsize", "FLOAT_ITEMSIZE"]
