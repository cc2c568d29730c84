"""Byte shuffle: exact round trip for every input, the documented stream layout, and the compression it buys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.errors import CorruptData, InvalidCacheState
from kvshelf.store.objects.shuffle import shuffle, shuffle_itemsize, unshuffle


@settings(max_examples=200, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 300), data=st.data())
def test_round_trip_is_exact_for_any_bytes(itemsize: int, n: int, data) -> None:
    raw = data.draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    shuffled = shuffle(raw, itemsize)
    assert len(shuffled) == len(raw)
    assert unshuffle(shuffled, itemsize) == raw


def test_stream_layout() -> None:
    raw = bytes([0x10, 0x11, 0x20, 0x21, 0x30, 0x31])
    assert shuffle(raw, 2) == bytes([0x10, 0x20, 0x30, 0x11, 0x21, 0x31])
    assert shuffle(raw, 1) == raw


def test_bfloat16_plane_round_trips_bit_identical_and_compresses_better() -> None:
    mx.random.seed(7)
    steps = mx.random.normal((1, 2048, 64)) * 0.1
    plane = (mx.cumsum(steps, axis=1) * 0.05).astype(mx.bfloat16)  # smooth along tokens, like KV
    host = np.array(plane.view(mx.uint16))
    raw = host.tobytes()
    assert shuffle_itemsize("bfloat16") == 2 and shuffle_itemsize("uint32") == 1
    shuffled = shuffle(host, 2)
    back = np.frombuffer(unshuffle(shuffled, 2), dtype=np.uint16).reshape(host.shape)
    assert np.array_equal(back, host)
    assert mx.array_equal(mx.array(back).view(mx.bfloat16), plane).item()
    cctx = zstandard.ZstdCompressor(level=1)
    assert len(cctx.compress(shuffled)) < len(cctx.compress(raw))


def test_bad_lengths_are_rejected() -> None:
    with pytest.raises(InvalidCacheState, match="whole number"):
        shuffle(b"abc", 2)
    with pytest.raises(CorruptData, match="whole number"):
        unshuffle(b"abcde", 4)
    with pytest.raises(InvalidCacheState, match="itemsize"):
        shuffle(b"", 0)
