"""Shared test settings: the hypothesis ``ci`` profile (derandomized, no deadline) and latent-cache helpers."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
