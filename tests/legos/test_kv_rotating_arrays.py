"""RotatingKVCache (trim only before the wrap, rollback of one multi-token append, rows laid out alike) and
ArraysCache (recurrent state: never trimmable, snapshot-and-replay rounds, rows along the batch axis)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kv_cases import kv, same

from kvshelf.errors import CacheRangeError, InvalidCacheState
from kvshelf.latent_legos import PrefillPadding
from kvshelf.latent_legos.kv import ArraysCache, RotatingKVCache


def ring(steps, max_size=8, keep=2, seed=0, batch=1):
    cache = RotatingKVCache(max_size, keep)
    for i, n in enumerate(steps):
        cache.update_and_fetch(*kv(batch, n, seed + i))
    return cache


def test_ring_trims_only_before_the_wrap():
    cache = ring([5, 1])
    assert cache.is_trimmable() and cache.trim(2) == 2 and (cache.offset, cache.idx) == (4, 4)
    wrapped = ring([5, 1, 1, 1])
    assert not wrapped.is_trimmable() and wrapped.trim(0) == 0
    with pytest.raises(CacheRangeError, match="wrapped"):
        wrapped.trim(1)
    assert wrapped.offset == 8


def test_trim_before_the_wrap_equals_never_appending():
    trimmed = ring([5, 2])
    trimmed.trim(2)
    plain = ring([5])
    for i in range(6):  # through the wrap: identical reads and ring heads
        step = kv(1, 1, 60 + i)
        assert same(trimmed.update_and_fetch(*step), plain.update_and_fetch(*step))
        assert (trimmed.offset, trimmed.idx) == (plain.offset, plain.idx)


def test_rollback_of_one_multi_token_append_after_the_wrap_cuts_its_tail():
    block = kv(1, 5, 77)
    cache = ring([6, 1, 1, 1])  # wrapped
    cache.spec_round_begin()
    cache.update_and_fetch(*block)
    cache.spec_round_rollback(3)
    expect = ring([6, 1, 1, 1])
    expect.update_and_fetch(block[0][:, :, :3], block[1][:, :, :3])
    assert (cache.offset, cache.idx) == (expect.offset, expect.idx) == (12, expect.keys.shape[2])
    assert same(cache.state, expect.state)
    for i in range(4):
        step = kv(1, 1 + (i == 2), 80 + i)
        assert same(cache.update_and_fetch(*step), expect.update_and_fetch(*step))
    cache.spec_round_begin()
    for i in range(2):
        cache.update_and_fetch(*kv(1, 1, 90 + i))
    with pytest.raises(CacheRangeError, match="ring wrapped"):
        cache.spec_round_rollback(1)


def test_ring_rows_batch_when_laid_out_alike():
    rows = [ring([5, 1, 1, 1], seed=s) for s in (0, 10, 20)]
    batched = rows[0].make_empty_batch()
    batched.merge_rows(rows)
    assert (batched.batch_size, batched.row_offsets, batched.left_pad) == (3, [8, 8, 8], [0, 0, 0])
    step = kv(3, 1, 5)
    out = batched.update_and_fetch(*step)
    for b, row in enumerate(rows):
        want = row.update_and_fetch(step[0][b : b + 1], step[1][b : b + 1])
        assert same([o[b : b + 1] for o in out], want)
        assert same(batched.extract_row(b).state, row.state)
    batched.filter_rows([2, 0])
    assert same(batched.state[0][0:1], rows[2].state[0]) and batched.batch_size == 2
    with pytest.raises(InvalidCacheState, match="laid out alike"):
        batched.merge_rows([ring([5, 1]), ring([6])])
    with pytest.raises(InvalidCacheState, match="max_size"):
        batched.merge_rows([RotatingKVCache(16)])
    with pytest.raises(InvalidCacheState, match="unpadded"):
        RotatingKVCache(8).prepare_prefill(PrefillPadding([3, 2], right_padding=[0, 1]))
    for bad in ((0, 0), (8, 8), (8, -1)):
        with pytest.raises(InvalidCacheState):
            RotatingKVCache(*bad)


def test_ring_accounting():
    cache = ring([3], max_size=8)
    assert cache.signature() == "kv:rotating-plain" and cache.size() == 3
    assert cache.bytes_per_token() == 2 * (64 + 64) * 2 and cache.projected_bytes(100) == 8 * cache.bytes_per_token()


def recurrent(batch=1, seed=0) -> ArraysCache:
    cache = ArraysCache(2)
    k1, k2 = mx.random.split(mx.random.key(seed))
    cache[0] = mx.random.normal((batch, 3, 8), key=k1)
    cache[1] = mx.random.normal((batch, 2, 4, 4), key=k2)
    cache.advance(5)
    return cache


def test_recurrent_state_is_never_trimmable():
    cache = recurrent()
    assert not cache.is_trimmable() and cache.trim(0) == 0 and cache.bytes_per_token() == 0
    with pytest.raises(CacheRangeError, match="cannot be trimmed"):
        cache.trim(1)
    assert cache.offset == 5 and cache.projected_bytes(10_000) == (3 * 8 + 2 * 4 * 4) * 4
    assert cache.signature() == "arrays:2" and len(cache.state) == 2


def test_rejected_round_restores_the_state_for_replay():
    cache = recurrent()
    before = [mx.array(a) for a in cache.state]
    cache.spec_round_begin()
    cache[1] = cache[1] + 1
    cache.advance(3)
    cache.spec_round_rollback(3)  # all kept: nothing changes
    assert cache.offset == 8
    cache.spec_round_begin()
    cache[1] = cache[1] * 2
    cache.advance(2)
    cache.spec_round_rollback(1)
    assert cache.offset == 8 and same(cache.state[1], before[1] + 1) and same(cache.state[0], before[0])
    with pytest.raises(InvalidCacheState):
        cache.spec_round_rollback(1)


def test_recurrent_rows_merge_extract_filter():
    rows = [recurrent(seed=s) for s in range(3)]
    rows[1].advance(2)
    partial = ArraysCache(2)
    partial[1] = mx.ones((1, 2, 4, 4))
    partial.advance(1)
    batched = ArraysCache(2)
    batched.merge_rows([*rows, partial])
    assert batched.batch_size == 4 and batched.row_offsets == [5, 7, 5, 1]
    assert not np.array(batched[0][3]).any()  # a slot the row never set merges as zeros
    assert same(batched.extract_row(1).state, rows[1].state) and batched.extract_row(1).offset == 7
    batched.filter_rows([1, 3])
    assert batched.row_offsets == [7, 1] and same(batched[1][0:1], rows[1][1])
    with pytest.raises(InvalidCacheState):
        batched.filter_rows([0, 0])
    with pytest.raises(InvalidCacheState):
        batched.merge_rows([ArraysCache(3)])
    with pytest.raises(InvalidCacheState, match="batch"):
        batched[0] = mx.zeros((3, 3, 8))


def test_padded_prefill_bookkeeping_and_mlx_lm_mask():
    cache = ArraysCache(2)
    cache.prepare_prefill(PrefillPadding([4, 4, 2], left_padding=[1, 0, 0], right_padding=[0, 0, 2]))
    assert np.array(cache.make_mask(4)).tolist() == [
        [False, True, True, True], [True, True, True, True], [True, True, False, False]
    ]
    cache[0] = mx.zeros((3, 3, 8))
    cache.advance(4)
    cache.finalize_prefill()
    assert cache.row_offsets == [3, 4, 2] and cache.make_mask(1) is None
    legacy = ArraysCache(1, left_padding=[2, 0])  # mlx-lm's constructor form
    assert legacy.row_offsets == [-2, 0] and np.array(legacy.make_mask(3)).tolist() == [
        [False, False, True], [True, True, True]
    ]
