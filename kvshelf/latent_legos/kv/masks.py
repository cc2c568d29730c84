"""Attention masks in mlx-lm's convention: ``None`` (no mask), the string ``"causal"``, or a bool array.

The SDPA kernels align a string ``"causal"`` bottom-right, so a serial cache never materializes a mask unless a
window or ``return_array`` asks for one; rows with left padding need an explicit ``[B, 1, N, offset + N]`` array.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ...errors import InvalidCacheState


def causal_mask(
    n: int, offset: int, window_size: int | None = None, left_pad: Sequence[int] | None = None
) -> mx.array:
    """Query i (column ``offset + i``) sees key j iff ``j <= offset + i`` (and ``offset + i < j + window``).

    With ``left_pad`` the mask is ``[B, 1, n, offset + n]`` and row b also hides keys ``j < left_pad[b]``.
    """
    keys = mx.arange(offset + n, dtype=mx.int32)[None, :]
    queries = mx.arange(offset, offset + n, dtype=mx.int32)[:, None]
    mask = queries >= keys
    if window_size is not None:
        mask = mask & (queries < keys + window_size)
    if left_pad is not None:
        pads = mx.array([int(p) for p in left_pad], dtype=mx.int32)[:, None, None, None]
        mask = mask[None, None] & (keys[None, None] >= pads)
    return mask


def attention_mask(
    n: int, offset: int, return_array: bool, window_size: int | None, left_pad: Sequence[int] = ()
) -> mx.array | str | None:
    """The mask for an ``n``-token step appended at ``offset`` (mlx-lm ``create_attention_mask`` rules)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidCacheState(f"mask step must be a positive integer (got {n!r})")
    if any(left_pad):
        return causal_mask(n, offset, window_size, left_pad)
    if window_size is not None or (n > 1 and return_array):
        return causal_mask(n, offset, window_size)
    if n == 1:
        return None
    return "causal"


__all__ = ["attention_mask", "causal_mask"]
