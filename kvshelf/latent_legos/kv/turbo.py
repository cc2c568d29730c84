"""``TurboQuantKVCache(k_bits=8, v_bits=3)``: TurboQuant-coded keys and values (``kv:turboquant:<k>:<v>``).

Five planes in a fixed order: key codes ``[B, H, S, D*k_bits/8]`` (int8 at 8 bits, else bit-packed uint8), key
scales and zeros ``[B, H, S, D/32]`` float16, value codes ``[B, H, S, D*v_bits/8]`` uint8 (unpacked at 8) and value
scales ``[B, H, S, D/32]`` float16. Each append encodes only its new positions; a read decodes the whole live window
to bfloat16, so attention code sees plain keys and values. Zero planes (padding) decode to zeros. Head dims must be
one of 64, 128, 256 or 512 (the rotation is a power-of-two Walsh–Hadamard transform).
"""

from __future__ import annotations

import mlx.core as mx

from ...errors import InvalidCacheState
from ..encodings.turboquant import (
    decode_keys,
    decode_values,
    encode_keys,
    encode_values,
    pack_bits,
    unpack_bits,
)
from ..formats import TurboFormat
from .dtypes import check_float
from .model_face import NotForModelCode
from .token_rows import TokenRows, zero_columns

HEAD_DIMS = (64, 128, 256, 512)


def check_head_dim(name: str, dim: int) -> None:
    if dim not in HEAD_DIMS:
        raise InvalidCacheState(f"TurboQuant {name} head dim must be one of {HEAD_DIMS} (got {dim})")


class TurboQuantKVCache(TokenRows):
    """TurboQuant keys (affine per 32-group) and values (rotated Lloyd–Max codes); see the module docstring."""

    def __init__(self, k_bits: int = 8, v_bits: int = 3) -> None:
        self.format = TurboFormat(k_bits, v_bits)  # validates the bit widths
        super().__init__()
        self.k_bits, self.v_bits = k_bits, v_bits

    def signature(self) -> str:
        return f"kv:turboquant:{self.k_bits}:{self.v_bits}"

    def _new_empty(self) -> TurboQuantKVCache:
        return TurboQuantKVCache(self.k_bits, self.v_bits)

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        """The five planes of ``keys [..., Dk]`` / ``values [..., Dv]``."""
        check_float("keys", keys)
        check_float("values", values)
        check_head_dim("key", keys.shape[-1])
        check_head_dim("value", values.shape[-1])
        k_codes, k_scales, k_zeros = encode_keys(keys, self.k_bits)
        if self.k_bits < 8:
            k_codes = pack_bits(k_codes, self.k_bits)
        v_codes, v_scales = encode_values(values, self.v_bits)
        return [k_codes, k_scales, k_zeros, pack_bits(v_codes, self.v_bits), v_scales]

    def _encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        return self.encode(keys, values)

    def head_dims(self) -> tuple[int, int] | None:
        """(Dk, Dv) once known (the value scales carry Dv/32 groups)."""
        if not self._planes:
            return None
        return self._planes[1].shape[3] * 32, self._planes[4].shape[3] * 32

    @property
    def keys(self) -> mx.array:
        """Not offered: mlx-lm code that reads or re-assigns ``cache.keys`` (glm_moe_dsa's indexer, pipeline
        parallelism) would need plain buffers; this cache holds codes. Reads go through ``keys_and_values()``."""
        raise NotForModelCode(
            "TurboQuantKVCache holds codes, not key/value buffers: model code that reads or assigns cache.keys / "
            "cache.values (glm_moe_dsa's indexer, pipeline-parallel models) cannot use it; use KVCache there"
        )

    @property
    def values(self) -> mx.array:
        return self.keys

    def _fetch(self, planes: list[mx.array]) -> tuple[mx.array, mx.array]:
        k_codes, k_scales, k_zeros, v_codes, v_scales = planes
        dk, dv = k_scales.shape[3] * 32, v_scales.shape[3] * 32
        if self.k_bits < 8:
            k_codes = unpack_bits(k_codes, self.k_bits, dk)
        keys = decode_keys(k_codes, k_scales, k_zeros)
        values = decode_values(unpack_bits(v_codes, self.v_bits, dv), v_scales, self.v_bits)
        return keys, values

    @classmethod
    def from_kv_cache(cls, source, k_bits: int = 8, v_bits: int = 3) -> TurboQuantKVCache:
        """Encode ``source``'s live window (a ``KVCache``); rows, offset and floor carry over; source unchanged."""
        out = cls(k_bits, v_bits)
        planes = out.encode(*source._active()) if source._planes else []
        planes = [zero_columns(p, source.left_pad) for p in planes]  # padding is stored as zero planes
        out._adopt_rows_of(source, planes)
        return out


__all__ = ["HEAD_DIMS", "TurboQuantKVCache", "check_head_dim"]
