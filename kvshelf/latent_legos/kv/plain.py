"""``KVCache``: mlx-lm's default key/value cache (``kv:plain``), with kvshelf's row contract on top.

Keys ``[B, H, S, Dk]`` and values ``[B, H, S, Dv]`` in the model's dtype, S growing in 256-token steps; reads are
views cut to ``offset``; ``trim`` only lowers ``offset``. One serial row reads bit-identically to
``mlx_lm.models.cache.KVCache`` on the same appends.

``keys`` and ``values`` are assignable with an array of the buffer's shape and dtype, as on mlx-lm's cache: mlx-lm
model code re-assigns them (glm_moe_dsa's indexer zeroes its values each step; pipeline-parallel models chain
``mx.depends`` onto the keys). As a merge source (mlx-lm's ``merge``/``extend`` in ``BatchGenerator``) a plain
cache also takes mlx-lm's own ``KVCache`` and ``BatchKVCache`` rows, whose bytes are the same.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ...errors import InvalidCacheState
from .dtypes import FLOAT_DTYPES, check_float, check_kv_dtypes
from .quantized import QuantizedKVCache
from .token_rows import KvRowState, TokenRows, zero_columns
from .turbo import TurboQuantKVCache


def _is_mlx_lm(cache: Any, name: str) -> bool:
    return type(cache).__name__ == name and type(cache).__module__.split(".", 1)[0] == "mlx_lm"


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

    def _replace_plane(self, index: int, name: str, value: mx.array) -> None:
        if not self._planes:
            raise InvalidCacheState(f"cannot assign {name}: this {self.signature()} cache holds nothing yet")
        plane = self._planes[index]
        if not isinstance(value, mx.array) or value.shape != plane.shape or value.dtype != plane.dtype:
            got = f"{list(value.shape)} {value.dtype}" if isinstance(value, mx.array) else type(value).__name__
            raise InvalidCacheState(f"{name} must be replaced by a {list(plane.shape)} {plane.dtype} array (got {got})")
        self._edited()  # the new buffer may differ anywhere below the offset
        self._planes[index] = value

    @property
    def keys(self) -> mx.array | None:
        """The key buffer (capacity included), as mlx-lm names it; None before the first append."""
        return self._planes[0] if self._planes else None

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._replace_plane(0, "keys", value)

    @property
    def values(self) -> mx.array | None:
        return self._planes[1] if self._planes else None

    @values.setter
    def values(self, value: mx.array) -> None:
        self._replace_plane(1, "values", value)

    def _row_source(self, cache: Any) -> Any:
        """mlx-lm's ``KVCache`` / ``BatchKVCache`` rows become plain rows (same bytes); kvshelf caches pass."""
        if _is_mlx_lm(cache, "BatchKVCache"):
            return self.merge([cache.extract(i) for i in range(int(cache.offset.shape[0]))])
        if _is_mlx_lm(cache, "KVCache"):
            out = KVCache()
            if cache.keys is not None and cache.offset:
                n = cache.offset
                out.merge_row_states([KvRowState([cache.keys[..., :n, :], cache.values[..., :n, :]], n)])
            return out
        return cache

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        """A ``QuantizedKVCache`` of the whole buffer (as mlx-lm), same rows, offset and floor; self unchanged."""
        out = QuantizedKVCache(group_size=group_size, bits=bits)
        planes = []
        if self._planes:
            for plane in self._planes:
                planes.extend(out.quantize(plane))
            planes = [zero_columns(p, self.left_pad) for p in planes]  # padding stays zero planes
        out._adopt_rows_of(self, planes)
        return out

    def to_turbo_quantized(self, k_bits: int = 8, v_bits: int = 3) -> TurboQuantKVCache:
        """A ``TurboQuantKVCache`` encoding the live window; same rows, offset and floor; self unchanged."""
        return TurboQuantKVCache.from_kv_cache(self, k_bits=k_bits, v_bits=v_bits)


__all__ = ["FLOAT_DTYPES", "KVCache", "check_float", "check_kv_dtypes"]
