"""The dtype rules every key/value lego applies to an append (shared, so no lego imports another for them)."""

from __future__ import annotations

import mlx.core as mx

from ...errors import InvalidCacheState

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def check_float(name: str, array: mx.array) -> None:
    if array.dtype not in FLOAT_DTYPES:
        raise InvalidCacheState(f"{name} must be float16, bfloat16 or float32 (got {array.dtype})")


def check_kv_dtypes(keys: mx.array, values: mx.array) -> None:
    """Floating keys and values of one dtype (the model's), which is what a snapshot records."""
    check_float("keys", keys)
    check_float("values", values)
    if keys.dtype != values.dtype:
        raise InvalidCacheState(f"keys ({keys.dtype}) and values ({values.dtype}) must share one dtype")


__all__ = ["FLOAT_DTYPES", "check_float", "check_kv_dtypes"]
