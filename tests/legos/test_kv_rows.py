"""The row contract of the token-axis key/value legos (KVCache, QuantizedKVCache, TurboQuantKVCache).

Rows are right-justified (mlx-lm's BatchKVCache geometry). Every batched read must equal, row by row, the read of a
serial cache given the same real tokens, with zeros in the padding columns — after merges, filters, speculative
rollbacks with per-row keeps and padded prefills.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cases import MAKERS, flat, kv, raw, same

from kvshelf.errors import CacheRangeError, InvalidCacheState
from kvshelf.latent_legos import PrefillPadding
from kvshelf.latent_legos.kv import KVCache, QuantizedKVCache, TurboQuantKVCache

KINDS = list(MAKERS)


def serial(kind: str, steps, seed: int):
    cache = MAKERS[kind]()
    for i, n in enumerate(steps):
        cache.update_and_fetch(*kv(1, n, seed * 100 + i))
    return cache


def planes_of(cache) -> list[mx.array]:
    return flat(cache.keys_and_values())


def assert_rows_match(batched, serials) -> None:
    """Row b of every read plane = serial b's plane after ``left_pad[b]`` zero columns (bit for bit)."""
    assert batched.row_offsets == [s.offset for s in serials]
    assert batched.left_pad == [batched.offset - s.offset for s in serials]
    for b, (pad, s) in enumerate(zip(batched.left_pad, serials)):
        for got, want in zip(planes_of(batched), planes_of(s)):
            assert same(got[b : b + 1, :, pad:], want)
            # padding columns read zero (TurboQuant's inverse rotation may give -0.0 there, still a zero)
            assert not np.array(got[b, :, :pad].astype(mx.float32)).any()


def batch_of(kind: str, lengths, seed: int = 0):
    rows = [serial(kind, [n], seed + i) for i, n in enumerate(lengths)]
    batched = MAKERS[kind]()
    batched.merge_rows(rows)
    return batched, rows


@pytest.mark.parametrize("kind", KINDS)
def test_merge_then_append_reads_every_row_like_its_serial_cache(kind):
    batched, rows = batch_of(kind, [5, 2, 9])
    assert (batched.batch_size, batched.offset) == (3, 9)
    assert_rows_match(batched, rows)
    keys, values = kv(3, 3, 77)
    batched.update_and_fetch(keys, values)
    for b, row in enumerate(rows):
        row.update_and_fetch(keys[b : b + 1], values[b : b + 1])
    assert_rows_match(batched, rows)
    for b, row in enumerate(rows):  # extract gives the serial cache back, padding removed
        out = batched.extract_row(b)
        assert (out.batch_size, out.offset, out.left_pad) == (1, row.offset, [0])
        assert same(planes_of(out), planes_of(row))


@pytest.mark.parametrize("kind", KINDS)
def test_filter_rows_keeps_order_and_drops_common_padding(kind):
    batched, rows = batch_of(kind, [5, 2, 9, 4])
    batched.filter_rows([3, 1, 0])
    assert (batched.batch_size, batched.offset, batched.left_pad) == (3, 5, [1, 3, 0])
    assert_rows_match(batched, [rows[3], rows[1], rows[0]])


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_with_per_row_keeps_never_shows_rejected_positions(kind):
    batched, rows = batch_of(kind, [6, 3, 8])
    batched.spec_round_begin()
    keys, values = kv(3, 4, 91)
    batched.update_and_fetch(keys, values)
    batched.spec_round_rollback([4, 1, 2])
    for b, (row, keep) in enumerate(zip(rows, [4, 1, 2])):
        row.update_and_fetch(keys[b : b + 1], values[b : b + 1])
        row.trim(4 - keep)
    assert batched.offset == 10  # common padding dropped: the longest row is 8 + 2
    assert_rows_match(batched, rows)
    batched.spec_round_begin()  # one shared count is a plain trim
    batched.update_and_fetch(*kv(3, 2, 92))
    batched.spec_round_rollback(0)
    assert_rows_match(batched, rows)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_prefill_rows_equal_serial_rows_of_their_real_tokens(kind):
    keys, values = kv(3, 7, 5)
    # left padding: row b's real tokens are its last 7 - lp[b] columns
    left = MAKERS[kind]()
    left.prepare_prefill(PrefillPadding([7, 7, 7], left_padding=[2, 4, 0]))
    left.update_and_fetch(keys, values)
    left.finalize_prefill()
    refs = []
    for b, lp in enumerate([2, 4, 0]):
        ref = MAKERS[kind]()
        ref.update_and_fetch(keys[b : b + 1, :, lp:], values[b : b + 1, :, lp:])
        refs.append(ref)
    assert left.left_pad == [2, 4, 0]
    assert_rows_match(left, refs)
    # right padding: row b's real tokens are its first lengths[b] columns; finalize turns the tail into leading pads
    right = MAKERS[kind]()
    right.prepare_prefill(PrefillPadding([5, 3, 7], right_padding=[2, 4, 0]))
    right.update_and_fetch(keys, values)
    right.finalize_prefill()
    refs = []
    for b, n in enumerate([5, 3, 7]):
        ref = MAKERS[kind]()
        ref.update_and_fetch(keys[b : b + 1, :, :n], values[b : b + 1, :, :n])
        refs.append(ref)
    assert right.left_pad == [2, 4, 0]
    assert_rows_match(right, refs)


def test_padded_rows_attend_like_serial_rows():
    """The left-padding mask makes batched attention equal per-row attention (float32, tolerance of reduction order)."""
    batched, rows = batch_of("kv", [5, 2, 9])
    q = mx.random.normal((3, 4, 2, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    mask = batched.make_mask(2)
    assert mask.shape == (3, 1, 2, 11) and mask.dtype == mx.bool_
    assert np.array(mask[1, 0]).tolist() == [[False] * 7 + [True, True, True, False], [False] * 7 + [True] * 4]
    keys, values = kv(3, 2, 8)
    out = mx.fast.scaled_dot_product_attention(q, *batched.update_and_fetch(keys, values), scale=0.125, mask=mask)
    for b, row in enumerate(rows):
        assert row.make_mask(2) == "causal" and row.make_mask(1) is None
        k, v = row.update_and_fetch(keys[b : b + 1], values[b : b + 1])
        want = mx.fast.scaled_dot_product_attention(q[b : b + 1], k, v, scale=0.125, mask="causal")
        assert np.allclose(np.array(out[b : b + 1].astype(mx.float32)), np.array(want.astype(mx.float32)), atol=2e-2)
    assert batched.rope_offset.tolist() == [7, 4, 11]


def test_conversions_keep_rows_and_padding():
    batched, rows = batch_of("kv", [5, 2, 9])
    batched.minimum_reusable_offset = 2
    q = batched.to_quantized(group_size=32, bits=4)
    t = batched.to_turbo_quantized(8, 3)
    for conv, kind in ((q, "qkv4"), (t, "turbo83")):
        assert (conv.row_offsets, conv.left_pad, conv.minimum_reusable_offset) == ([5, 2, 9], [4, 7, 0], 2)
        serials = [MAKERS[kind]() for _ in rows]
        for s, row in zip(serials, rows):
            s.update_and_fetch(*row.keys_and_values())
        assert_rows_match(conv, serials)


@pytest.mark.parametrize("kind", KINDS)
def test_rejected_calls_change_nothing(kind):
    batched, _ = batch_of(kind, [4, 2])
    before = [raw(a) for a in batched.state], batched.row_offsets, batched.offset
    bad_calls = [
        (lambda: batched.filter_rows([]), InvalidCacheState),
        (lambda: batched.filter_rows([0, 0]), InvalidCacheState),
        (lambda: batched.filter_rows([2]), CacheRangeError),
        (lambda: batched.merge_rows([]), InvalidCacheState),
        (lambda: batched.merge_rows([KVCache() if kind != "kv" else QuantizedKVCache()]), InvalidCacheState),
        (lambda: batched.update_and_fetch(*kv(3, 1, 0)), InvalidCacheState),  # wrong batch
        (lambda: batched.update_and_fetch(*kv(2, 1, 0, dk=128)), InvalidCacheState),  # wrong head dim
        (lambda: batched.update_and_fetch(mx.zeros((2, 2, 1, 64), dtype=mx.int32), mx.zeros((2, 2, 1, 64))),
         InvalidCacheState),
        (lambda: batched.update_and_fetch(mx.zeros((2, 1, 64)), mx.zeros((2, 1, 64))), InvalidCacheState),
        (lambda: batched.trim(-1), InvalidCacheState),
        (lambda: batched.spec_round_rollback(1), InvalidCacheState),
        (lambda: batched.prepare_prefill(PrefillPadding([1, 1, 1])), InvalidCacheState),
        (lambda: batched.prepare_prefill(PrefillPadding([1, 1], left_padding=[1, 0])), InvalidCacheState),
    ]
    for call, error in bad_calls:
        with pytest.raises(error):
            call()
        after = [raw(a) for a in batched.state]
        assert len(after) == len(before[0]) and all(np.array_equal(x, y) for x, y in zip(after, before[0]))
        assert (batched.row_offsets, batched.offset) == (before[1], before[2])
    batched.spec_round_begin()
    batched.update_and_fetch(*kv(2, 2, 1))
    with pytest.raises(CacheRangeError):
        batched.spec_round_rollback([3, 0])


def test_geometry_accounting_and_dispose():
    cache = KVCache()
    assert (cache.batch_size, cache.offset, cache.bytes_per_token(), cache.state) == (None, 0, 0, [])
    assert cache.signature() == "kv:plain"
    cache.update_and_fetch(*kv(2, 3, 0, heads=4, dk=64, dv=32))
    assert cache.bytes_per_token() == 4 * (64 + 32) * 2 and cache.projected_bytes(10) == 10 * 4 * 96 * 2
    assert [a.shape for a in cache.state] == [(2, 4, 256, 64), (2, 4, 256, 32)]
    q = QuantizedKVCache(group_size=64, bits=8)
    q.update_and_fetch(*kv(1, 1, 0))
    assert q.signature() == "kv:quant:8:64" and q.bytes_per_token() == 2 * 2 * (64 + 2 + 2)
    t = TurboQuantKVCache(8, 3)
    t.update_and_fetch(*kv(1, 1, 0, dk=128, dv=128))
    assert t.signature() == "kv:turboquant:8:3" and t.bytes_per_token() == 2 * 200  # 2 heads x 200 bytes at k8v3
    for c in (cache, q, t):
        c.dispose()
        assert (c.batch_size, c.offset, c.state, c.row_offsets) == (None, 0, [], [])


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=12)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=2, max_size=4),
    rounds=st.lists(st.tuples(st.integers(1, 5), st.data()), min_size=1, max_size=4),
)
def test_random_rounds_and_filters_keep_every_row_equal_to_its_serial_cache(kind, lengths, rounds):
    batched, rows = batch_of(kind, lengths, seed=3)
    for r, (n, data) in enumerate(rounds):
        keys, values = kv(len(rows), n, 500 + r)
        batched.spec_round_begin()
        batched.update_and_fetch(keys, values)
        keep = data.draw(st.lists(st.integers(0, n), min_size=len(rows), max_size=len(rows)))
        batched.spec_round_rollback(keep)
        for b, row in enumerate(rows):
            row.update_and_fetch(keys[b : b + 1], values[b : b + 1])
            row.trim(n - keep[b])
        assert_rows_match(batched, rows)
        if len(rows) > 1 and data.draw(st.booleans()):
            survivors = data.draw(st.permutations(range(len(rows))))[: data.draw(st.integers(1, len(rows)))]
            batched.filter_rows(survivors)
            rows = [rows[k] for k in survivors]
            assert batched.offset == max(r.offset for r in rows)
            assert_rows_match(batched, rows)
