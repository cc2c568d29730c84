"""MLACache behaviour, and the validation every latent lego shares (each rejected call leaves the cache as it was)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from bit_exact import assert_unchanged, bits, snapshot_state
from kvshelf.errors import CacheRangeError, InvalidCacheState
from kvshelf.latent_legos import (
    AffineFormat,
    EncodedLatentCache,
    LatentAttentionCache,
    LatentGeometry,
    MLACache,
    MLARowState,
    PagedLatentCache,
    PrefillPadding,
    TurboFormat,
)

DSA = LatentGeometry(kv_lora_rank=64, rope_head_dim=64, index_head_dim=64, max_tokens=20)
PLAIN = LatentGeometry(kv_lora_rank=64, rope_head_dim=64, max_tokens=20)


def inputs(geometry: LatentGeometry, batch: int, length: int, seed: int = 0) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((batch, length, w)).astype(np.float32) + 1.0) for w in geometry.widths]


FACTORIES = {
    "mla": lambda g: MLACache(g),
    "paged": lambda g: PagedLatentCache(g, None, 3),
    "paged-affine": lambda g: PagedLatentCache(g, AffineFormat(8, 64), 4),
    "encoded-affine": lambda g: EncodedLatentCache(g, AffineFormat(8, 64), 0),
    "encoded-turbo": lambda g: EncodedLatentCache(g, TurboFormat(8, 3), 6),
}


def loaded(kind: str, geometry: LatentGeometry = DSA):
    """A batch of two rows of 5 and 3 positions (row 1 left-padded by 2)."""
    make = FACTORIES[kind]
    first, second = make(geometry), make(geometry)
    first.append_latent(*inputs(geometry, 1, 5, 1))
    second.append_latent(*inputs(geometry, 1, 3, 2))
    cache = make(geometry)
    cache.merge_rows([first, second])
    assert (cache.offset, cache.row_offsets, cache.left_pad) == (5, [5, 3], [0, 2])
    return cache


@pytest.fixture(params=sorted(FACTORIES))
def kind(request):
    return request.param


def rejected(cache, error, call):
    before = snapshot_state(cache)
    with pytest.raises(error) as info:
        call()
    assert_unchanged(before, cache)
    return str(info.value)


def test_append_validation_leaves_the_cache_unchanged(kind):
    cache = loaded(kind)
    latent, rope, index = inputs(DSA, 2, 2)
    assert "float32" in rejected(cache, InvalidCacheState, lambda: cache.append_latent(latent.astype(mx.float16), rope, index))
    assert "float32" in rejected(cache, InvalidCacheState, lambda: cache.append_latent(latent, rope, index.astype(mx.bfloat16)))
    assert "rank" in rejected(cache, InvalidCacheState, lambda: cache.append_latent(latent[0], rope, index))
    assert "shape" in rejected(cache, InvalidCacheState, lambda: cache.append_latent(latent[:, :, :32], rope, index))
    assert "shape" in rejected(cache, InvalidCacheState, lambda: cache.append_latent(latent, rope[:, :1], index))
    assert "index" in rejected(cache, InvalidCacheState, lambda: cache.append_latent(latent, rope, None))
    three = inputs(DSA, 3, 2)
    assert "batch size 3" in rejected(cache, InvalidCacheState, lambda: cache.append_latent(*three))
    too_long = inputs(DSA, 2, 16)
    assert "max_tokens 20" in rejected(cache, CacheRangeError, lambda: cache.append_latent(*too_long))
    cache.append_latent(*inputs(DSA, 2, 15))  # exactly to the cap
    assert cache.row_offsets == [20, 18]


def test_unexpected_index_keys_are_rejected(kind):
    cache = FACTORIES[kind](PLAIN)
    latent, rope, index = inputs(DSA, 1, 2)
    rejected(cache, InvalidCacheState, lambda: cache.append_latent(latent, rope, index))
    assert cache.batch_size is None and cache.offset == 0
    assert cache.append_latent(latent, rope).index_keys is None
    assert cache.stored_index_keys() is None


def test_row_operation_validation_leaves_the_cache_unchanged(kind):
    cache = loaded(kind)
    rejected(cache, CacheRangeError, lambda: cache.trim(4))
    rejected(cache, InvalidCacheState, lambda: cache.trim(-1))
    rejected(cache, CacheRangeError, lambda: cache.extract_row(2))
    rejected(cache, CacheRangeError, lambda: cache.extract_row(-1))
    rejected(cache, InvalidCacheState, lambda: cache.filter_rows([]))
    rejected(cache, InvalidCacheState, lambda: cache.filter_rows([1, 1]))
    rejected(cache, CacheRangeError, lambda: cache.filter_rows([0, 2]))
    rejected(cache, InvalidCacheState, lambda: cache.merge_rows([cache.extract_row(0)]))
    empty = cache.make_empty_batch()
    rejected(empty, InvalidCacheState, lambda: empty.merge_rows([]))
    other = MLACache(PLAIN) if kind != "mla" else PagedLatentCache(DSA, None, 3)
    other.append_latent(*inputs(other.geometry, 1, 2))
    assert "cannot merge" in rejected(empty, InvalidCacheState, lambda: empty.merge_rows([other]))
    wider = FACTORIES[kind](LatentGeometry(64, 64, 64, max_tokens=30))
    wider.append_latent(*inputs(DSA, 1, 2))
    assert "geometry" in rejected(empty, InvalidCacheState, lambda: empty.merge_rows([wider]))
    rejected(cache, InvalidCacheState, lambda: cache.spec_round_rollback(1))
    cache.spec_round_begin()
    cache.append_latent(*inputs(DSA, 2, 2))
    rejected(cache, CacheRangeError, lambda: cache.spec_round_rollback(3))
    rejected(cache, CacheRangeError, lambda: cache.spec_round_rollback([1, 3]))
    rejected(cache, InvalidCacheState, lambda: cache.spec_round_rollback([1, 1, 1]))
    cache.spec_round_rollback([2, 0])
    assert cache.row_offsets == [7, 3] and cache.left_pad == [0, 4]
    rejected(cache, InvalidCacheState, lambda: cache.prepare_prefill(PrefillPadding([2, 2], [1, 0])))
    rejected(cache, InvalidCacheState, lambda: cache.prepare_prefill(PrefillPadding([2, 2, 2])))
    with pytest.raises(InvalidCacheState):
        PrefillPadding([2, -1])


def test_every_reject_on_an_empty_cache(kind):
    cache = FACTORIES[kind](DSA)
    rejected(cache, InvalidCacheState, lambda: cache.extract_row(0))
    rejected(cache, InvalidCacheState, lambda: cache.filter_rows([0]))
    rejected(cache, CacheRangeError, lambda: cache.trim(1))
    assert cache.trim(0) == 0


def test_padding_reads_zero_after_unequal_rollback(kind):
    cache = loaded(kind)
    cache.spec_round_begin()
    cache.append_latent(*inputs(DSA, 2, 3, 9))
    cache.spec_round_rollback([0, 3])
    assert (cache.offset, cache.row_offsets, cache.left_pad) == (6, [5, 6], [1, 0])
    read = cache.read_latent()
    for values in (read.latent, read.rope, read.index_keys):
        assert np.all(np.array(values)[0, 0] == 0.0)
        assert np.all(np.any(np.array(values)[0, 1:] != 0.0, axis=-1))  # every kept position holds values
    assert np.all(np.any(np.array(read.latent)[1] != 0.0, axis=-1))


def test_mla_reads_are_the_appended_bits_right_justified():
    cache = MLACache(DSA)
    a = inputs(DSA, 2, 3, 1)
    first = cache.append_latent(*a)
    for got, want in zip((first.latent, first.rope, first.index_keys), a):
        assert np.array_equal(bits(got), bits(want))
    first.latent[0, 0, 0] = 123.0  # a read is the caller's: writing to it cannot reach the cache
    assert float(cache.state[0][0, 0, 0]) == float(a[0][0, 0, 0])
    assert cache.signature() == "kv:mla:target:dsa" and MLACache(PLAIN).signature() == "kv:mla:target"
    assert cache.bytes_per_token() == 4 * 192 and cache.projected_bytes(10) == 10 * 4 * 192
    assert [tuple(s.shape) for s in cache.state] == [(2, 3, 64)] * 3
    assert np.array_equal(bits(cache.stored_index_keys()), bits(a[2]))


def test_mla_trim_rows_state_and_merge():
    cache = loaded("mla")
    cache.minimum_reusable_offset = 2
    with pytest.raises(InvalidCacheState):
        cache.minimum_reusable_offset = -1
    state = cache.row_state(1)
    assert isinstance(state, MLARowState) and state.offset == 3 and state.minimum_reusable_offset == 2
    assert [tuple(a.shape) for a in state.arrays] == [(1, 3, 64)] * 3
    assert np.array_equal(bits(state.arrays[0][0]), bits(inputs(DSA, 1, 3, 2)[0][0]))
    assert cache.trim(3) == 3
    assert (cache.offset, cache.row_offsets, cache.left_pad) == (2, [2, 0], [0, 2])
    assert np.all(np.array(cache.state[1])[1] == 0.0)
    assert cache.trim(0) == 0
    cache.filter_rows([1])
    assert (cache.offset, cache.row_offsets, cache.batch_size, cache.state) == (0, [0], 1, [])
    restored = MLACache(DSA)
    restored.restore_row(state)
    assert (restored.batch_size, restored.offset, restored.minimum_reusable_offset) == (1, 3, 2)
    cache.dispose()
    assert (cache.batch_size, cache.offset, cache.minimum_reusable_offset, cache.row_offsets) == (None, 0, 0, [])


def test_merge_row_states_rejects_bad_shapes():
    cache = MLACache(DSA)
    good = MLARowState([a[:1] for a in inputs(DSA, 1, 3)], 3, 0)
    for bad in (
        MLARowState(good.arrays[:2], 3, 0),
        MLARowState(good.arrays, 4, 0),
        MLARowState([good.arrays[0].astype(mx.float16), *good.arrays[1:]], 3, 0),
        MLARowState(good.arrays, 3, -1),
    ):
        with pytest.raises(InvalidCacheState):
            cache.merge_row_states([good, bad])
        assert cache.batch_size is None
    with pytest.raises(CacheRangeError):
        cache.merge_row_states([MLARowState([a[:1] for a in inputs(DSA, 1, 21)], 21, 0)])
    cache.merge_row_states([good])
    with pytest.raises(InvalidCacheState):
        cache.merge_row_states([good])


def test_prefill_padding_left_and_right():
    cache = MLACache(PLAIN)
    cache.prepare_prefill(PrefillPadding(lengths=[4, 3], left_padding=[1, 0], right_padding=[0, 1]))
    latent, rope = inputs(PLAIN, 2, 4, 5)
    read = cache.append_latent(latent, rope)
    assert np.all(np.array(read.latent)[0, 0] == 0.0)  # left padding reads zeros from the first read on
    assert cache.row_offsets == [3, 4] and cache.left_pad == [1, 0]
    cache.finalize_prefill()
    assert (cache.offset, cache.row_offsets, cache.left_pad) == (3, [3, 3], [0, 0])
    got = np.array(cache.state[0])
    assert np.array_equal(bits(got[0]), bits(np.array(latent)[0, 1:]))
    assert np.array_equal(bits(got[1]), bits(np.array(latent)[1, :3]))
    cache.finalize_prefill()  # nothing pending: no change
    assert cache.offset == 3


def test_a_round_begun_before_the_first_append_rolls_back_from_zero(kind):
    cache = FACTORIES[kind](DSA)
    assert isinstance(cache, LatentAttentionCache)
    cache.spec_round_begin()
    cache.append_latent(*inputs(DSA, 2, 4))
    cache.spec_round_rollback([1, 3])
    assert (cache.offset, cache.row_offsets, cache.left_pad) == (3, [1, 3], [2, 0])
    read = cache.read_latent()
    assert np.all(np.array(read.latent)[0, :2] == 0.0)
