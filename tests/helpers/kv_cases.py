"""Shared helpers for the key/value lego tests: deterministic inputs, bit-exact comparison, per-row references."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvshelf.latent_legos.kv import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, TurboQuantKVCache

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def raw(array: mx.array) -> np.ndarray:
    """The array's bit patterns as unsigned integers (so equality is bit-identity, NaN and -0.0 included)."""
    return np.array(array.view(_UINT[array.itemsize]) if array.dtype != mx.bool_ else array)


def same(a, b) -> bool:
    """Bit-identical: same structure, shapes, dtypes and bits (tuples of arrays compared element-wise)."""
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(raw(a), raw(b))


def kv(batch: int, length: int, seed: int, heads: int = 2, dk: int = 64, dv: int = 64, dtype=mx.bfloat16):
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    keys = mx.random.normal((batch, heads, length, dk), key=k1).astype(dtype)
    values = mx.random.normal((batch, heads, length, dv), key=k2).astype(dtype)
    return keys, values


def flat(fetched) -> list[mx.array]:
    out = []
    for item in fetched:
        out.extend(item if isinstance(item, (tuple, list)) else [item])
    return out


MAKERS = {
    "kv": KVCache,
    "qkv8": lambda: QuantizedKVCache(group_size=64, bits=8),
    "qkv4": lambda: QuantizedKVCache(group_size=32, bits=4),
    "turbo83": lambda: TurboQuantKVCache(8, 3),
    "turbo44": lambda: TurboQuantKVCache(4, 4),
}


def fill(cache, steps, seed: int = 0, batch: int = 1, **dims):
    """Append ``steps`` (token counts) of deterministic keys/values; the last read is returned."""
    out = None
    for i, n in enumerate(steps):
        out = cache.update_and_fetch(*kv(batch, n, seed * 1000 + i, **dims))
    return out


def dense(cache) -> tuple[mx.array, mx.array]:
    """The live keys and values as floating arrays, whatever the storage (quantized triples dequantized)."""
    if isinstance(cache, QuantizedKVCache):
        return cache.dequantized()
    return cache.keys_and_values()


__all__ = ["MAKERS", "raw", "same", "kv", "flat", "fill", "dense", "ArraysCache", "RotatingKVCache"]
