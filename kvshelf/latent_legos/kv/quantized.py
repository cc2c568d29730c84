"""``QuantizedKVCache(group_size=64, bits=8)``: affine triples for keys and values (``kv:quant:<bits>:<group>``).

Each of keys and values is ``(packed uint32 [B, H, S, D*bits/32], scales [B, H, S, D/g], biases [B, H, S, D/g])``
from ``mx.quantize`` (scales and biases in the input dtype). Groups run along the head dim, never the token axis,
so any token-axis slice of the planes is a valid state. Reads return the triples cut to ``offset`` (the cache has
``bits`` and ``group_size``, which is how mlx-lm's attention picks its quantized path).
"""

from __future__ import annotations

import mlx.core as mx

from ...errors import InvalidCacheState
from ..formats import AFFINE_BITS, AFFINE_GROUP_SIZES
from .dtypes import check_kv_dtypes
from .token_rows import TokenRows


class QuantizedKVCache(TokenRows):
    """Affine-quantized keys and values (see the module docstring)."""

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        if isinstance(bits, bool) or bits not in AFFINE_BITS:
            raise InvalidCacheState(f"affine bits must be one of {AFFINE_BITS} (got {bits!r})")
        if isinstance(group_size, bool) or group_size not in AFFINE_GROUP_SIZES:
            raise InvalidCacheState(f"affine group size must be one of {AFFINE_GROUP_SIZES} (got {group_size!r})")
        super().__init__()
        self.group_size = group_size
        self.bits = bits

    def signature(self) -> str:
        return f"kv:quant:{self.bits}:{self.group_size}"

    def _new_empty(self) -> QuantizedKVCache:
        return QuantizedKVCache(group_size=self.group_size, bits=self.bits)

    def quantize(self, x: mx.array) -> list[mx.array]:
        """``[packed, scales, biases]`` of ``x [..., D]`` in this cache's format (D must divide by the group size)."""
        if x.shape[-1] % self.group_size:
            raise InvalidCacheState(
                f"head dim {x.shape[-1]} is not a multiple of the affine group size {self.group_size}"
            )
        return list(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        check_kv_dtypes(keys, values)
        return [*self.quantize(keys), *self.quantize(values)]

    def _fetch(self, planes: list[mx.array]) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        return tuple(planes[:3]), tuple(planes[3:])

    @property
    def keys(self) -> tuple[mx.array, ...] | None:
        return tuple(self._planes[:3]) if self._planes else None

    @keys.setter
    def keys(self, value: object) -> None:
        self._refuse_assignment("keys")

    @property
    def values(self) -> tuple[mx.array, ...] | None:
        return tuple(self._planes[3:]) if self._planes else None

    @values.setter
    def values(self, value: object) -> None:
        self._refuse_assignment("values")

    def _refuse_assignment(self, name: str) -> None:
        """mlx-lm code assigning dense buffers (glm_moe_dsa's indexer, pipelines) would corrupt affine triples."""
        raise InvalidCacheState(
            f"cannot assign {name} of a {self.signature()} cache (it holds affine triples): model code that "
            "re-assigns cache.keys / cache.values (glm_moe_dsa's indexer, pipeline-parallel models) needs KVCache"
        )

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """The live keys and values decoded (zeros in padding) — for tests and dense readers."""
        if not self._planes:
            raise InvalidCacheState(f"this {self.signature()} cache holds no keys or values yet")
        k, v = self._fetch(self._active())
        return (
            mx.dequantize(*k, group_size=self.group_size, bits=self.bits),
            mx.dequantize(*v, group_size=self.group_size, bits=self.bits),
        )


__all__ = ["QuantizedKVCache"]
