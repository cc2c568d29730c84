"""Bit-exact comparison of latent caches: the raw bits of a float32 array, and everything a cache holds.

Equality of bits, not values, is what "restores bit-exact" means (0.0 != -0.0, NaN == NaN); ``snapshot_state`` and
``assert_unchanged`` check that a rejected call changed nothing.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def bits(array: mx.array | np.ndarray) -> np.ndarray:
    """The raw bit patterns of a float32 array, so equality means bit-identical (0.0 != -0.0, NaN == NaN)."""
    values = np.asarray(array, dtype=np.float32) if isinstance(array, np.ndarray) else np.array(array)
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def snapshot_state(cache) -> list[np.ndarray]:
    """Every array a cache holds (as numpy) plus its row bookkeeping, for "a rejected call changed nothing"."""
    mx.eval(cache.state)
    arrays = [np.array(a) for a in cache.state]
    return [*arrays, np.array([cache.offset, cache.batch_size or 0, cache.minimum_reusable_offset]),
            np.array(cache.row_offsets, dtype=np.int64), np.array(cache.left_pad, dtype=np.int64)]


def assert_unchanged(before: list[np.ndarray], cache) -> None:
    after = snapshot_state(cache)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
