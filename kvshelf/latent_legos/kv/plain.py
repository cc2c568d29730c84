"""``KVCache``: mlx-lm's default key/value cache (``kv:plain``), with kvshelf's row contract on top.

Keys ``[B, H, S, Dk]`` and values ``[B, H, S, Dv]`` in the model's dtype, S growing in 256-token steps; reads are
views cut to ``offset``; ``trim`` only lowers ``offset``. One serial row reads bit-identically to
``mlx_lm.models.cache.KVCache`` on the same appends.
"""

from __future__ import annotations

import mlx.core as mx

from ...errors import InvalidCacheState
from .token_rows import TokenRows, zero_columns

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


class KVCache(TokenRows):
    """Plain keys and values (see the module docstring)."""

    def signature(self) -> str:
        return "kv:plain"

    def _new_empty(self) -> KVCache:
        return KVCache()

    def _encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        check_kv_dtypes(keys, values)
        return [keys, values]

    def _fetch(self, planes: list[mx.array]) -> tuple[mx.array, mx.array]:
        return planes[0], planes[1]

    @property
    def keys(self) -> mx.array | None:
        """The key buffer (capacity included), as mlx-lm names it; None before the first append."""
        return self._planes[0] if self._planes else None

    @property
    def values(self) -> mx.array | None:
        return self._planes[1] if self._planes else None

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """A ``QuantizedKVCache`` of the whole buffer (as mlx-lm), same rows, offset and floor; self unchanged."""
        from .quantized import QuantizedKVCache

        out = QuantizedKVCache(group_size=group_size, bits=bits)
        planes = []
        if self._planes:
            for plane in self._planes:
                planes.extend(out.quantize(plane))
            planes = [zero_columns(p, self.left_pad) for p in planes]  # padding stays zero planes
        out._adopt_rows_of(self, planes)
        return out

    def to_turbo_quantized(self, k_bits: int = 8, v_bits: int = 3):
        """A ``TurboQuantKVCache`` encoding the live window; same rows, offset and floor; self unchanged."""
        from .turbo import TurboQuantKVCache

        return TurboQuantKVCache.from_kv_cache(self, k_bits=k_bits, v_bits=v_bits)


__all__ = ["KVCache"]
