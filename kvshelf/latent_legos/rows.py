"""Pure helpers over right-justified row storage: arrays ``[B, T, w]`` with positions on axis 1.

Nothing here mutates a cache; callers stage results from these and publish them together, which is what makes
a rejected call leave the cache unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..errors import CacheRangeError, InvalidCacheState
from .latent.geometry import LatentGeometry


def non_negative(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidCacheState(f"{name} must be a non-negative integer (got {value!r})")
    return value


def transition_due(offset: int, start: int) -> bool:
    """Storage converts once it holds at least ``start`` positions, never while empty (the f32-first rule)."""
    return offset >= start and offset != 0


def row_roll_indices(length: int, shifts: Sequence[int]) -> mx.array:
    """int32 ``[B, length, 1]`` with ``idx[b, j] = (j - shifts[b]) mod length``.

    ``take_along_axis(x, idx, axis=1)`` rolls row b of ``x`` right by ``shifts[b]`` (mlx-lm's ``dynamic_roll``).
    """
    columns = mx.arange(length, dtype=mx.int32)[None, :]
    back = mx.array([int(s) % length for s in shifts], dtype=mx.int32)[:, None]
    return ((columns - back) % length)[:, :, None]


def roll_rows_right(arrays: Sequence[mx.array], shifts: Sequence[int]) -> list[mx.array]:
    if not any(shifts) or not arrays:
        return list(arrays)
    indices = row_roll_indices(arrays[0].shape[1], shifts)
    return [mx.take_along_axis(a, indices, axis=1) for a in arrays]


def zero_leading(arrays: Sequence[mx.array], pads: Sequence[int]) -> list[mx.array]:
    """Columns before ``pads[b]`` of row b set to zero, every other bit kept."""
    if not any(p > 0 for p in pads) or not arrays:
        return list(arrays)
    width = arrays[0].shape[1]
    valid = mx.arange(width, dtype=mx.int32)[None, :] >= mx.array(list(pads), dtype=mx.int32)[:, None]
    valid = valid[:, :, None]
    return [mx.where(valid, a, mx.zeros((1, 1, 1), dtype=a.dtype)) for a in arrays]


def pad_left(array: mx.array, tokens: int) -> mx.array:
    """``array`` with ``tokens`` zero positions before it on axis 1."""
    if tokens == 0:
        return array
    zeros = mx.zeros((array.shape[0], tokens, *array.shape[2:]), dtype=array.dtype)
    return mx.concatenate([zeros, array], axis=1)


def pick_rows(use_first: Sequence[bool], first: mx.array, second: mx.array) -> mx.array:
    """Per row, ``first`` where ``use_first[b]`` else ``second`` (both ``[B, T, W]``)."""
    if all(use_first):
        return first
    if not any(use_first):
        return second
    mask = mx.array([bool(u) for u in use_first])[:, None, None]
    return mx.where(mask, first, second)


def owned(array: mx.array) -> mx.array:
    """A fresh array object over the same buffer: item assignment on it (which rebinds that object to a new
    array) cannot reach the cache's object, and nothing is copied."""
    return array[:]


def take_rows(arrays: Sequence[mx.array], keep: Sequence[int], start: int = 0) -> list[mx.array]:
    """Rows ``keep`` (in that order) of each array, from column ``start`` on."""
    index = mx.array(list(keep), dtype=mx.int32)
    return [mx.take(a[:, start:, :], index, axis=0) for a in arrays]


def check_f32(name: str, array: object, shape: tuple[int, ...]) -> None:
    if not isinstance(array, mx.array):
        raise InvalidCacheState(f"{name} must be an mlx array (got {type(array).__name__})")
    if array.dtype != mx.float32:
        raise InvalidCacheState(f"{name} must be float32 (got {array.dtype})")
    if tuple(array.shape) != shape:
        raise InvalidCacheState(f"{name} shape {tuple(array.shape)} != expected {shape}")


def append_inputs(
    geometry: LatentGeometry,
    latent: mx.array,
    rope: mx.array,
    index_keys: mx.array | None,
    batch: int | None,
) -> list[mx.array]:
    """Validate one append's inputs against the geometry and the existing batch; the families in stored order."""
    if not isinstance(latent, mx.array) or latent.ndim != 3:
        got = latent.ndim if isinstance(latent, mx.array) else type(latent).__name__
        raise InvalidCacheState(f"latent must be a rank-3 [B, L, kv_lora_rank] array (got rank {got})")
    b, length = latent.shape[0], latent.shape[1]
    if b < 1 or length < 1:
        raise InvalidCacheState(f"latent append needs at least one row and one token (got shape {latent.shape})")
    check_f32("latent", latent, (b, length, geometry.kv_lora_rank))
    check_f32("rope key", rope, (b, length, geometry.rope_head_dim))
    families = [latent, rope]
    if geometry.has_index:
        if index_keys is None:
            raise InvalidCacheState("this latent cache stores DSA index keys; index_keys is missing")
        check_f32("index keys", index_keys, (b, length, geometry.index_head_dim))
        families.append(index_keys)
    elif index_keys is not None:
        raise InvalidCacheState("this latent cache stores no DSA index keys; got index_keys")
    if batch is not None and b != batch:
        raise InvalidCacheState(f"latent batch size {b} != the cache's {batch}")
    return families


def check_token_room(geometry: LatentGeometry, row_offsets: Sequence[int], tokens: int) -> None:
    longest = max(row_offsets, default=0)
    if longest + tokens > geometry.token_limit:
        raise CacheRangeError(
            f"latent append of {tokens} tokens would exceed max_tokens {geometry.max_tokens} (longest row {longest})"
        )


def check_row_length(geometry: LatentGeometry, offset: int) -> None:
    """A row of ``offset`` positions fits the geometry's ``max_tokens``."""
    if offset > geometry.token_limit:
        raise CacheRangeError(f"row of {offset} positions exceeds max_tokens {geometry.max_tokens}")


def check_row(row: object, batch: int | None) -> int:
    if batch is None:
        raise InvalidCacheState("the latent cache holds no rows")
    if isinstance(row, bool) or not isinstance(row, int):
        raise InvalidCacheState(f"row index must be an integer (got {row!r})")
    if not 0 <= row < batch:
        raise CacheRangeError(f"row {row} out of range for batch size {batch}")
    return row


def check_keep(keep: Sequence[int], batch: int | None) -> list[int]:
    """Validate ``filter_rows`` indices: non-empty, in range, no duplicates."""
    keep = list(keep)
    if not keep:
        raise InvalidCacheState("filter_rows cannot keep zero rows")
    for row in keep:
        check_row(row, batch)
    if len(set(keep)) != len(keep):
        raise InvalidCacheState(f"filter_rows got duplicate rows {keep}")
    return keep


def prefill_leads(row_offsets: Sequence[int]) -> list[int]:
    """Per row, the left-padding columns still to come: a prepared row's offset runs negative until they land."""
    return [max(0, -o) for o in row_offsets]


def zero_prefill_leads(families: Sequence[mx.array], leads: Sequence[int]) -> list[mx.array]:
    """Input columns that land in pending left padding become zeros (padding always reads zeros)."""
    return zero_leading(families, leads)
