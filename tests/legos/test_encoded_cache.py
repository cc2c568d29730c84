"""EncodedLatentCache: the f32-first rule, per-row conversion, row states, merge, prefill padding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from bit_exact import bits
from kvshelf.errors import InvalidCacheState
from kvshelf.latent_legos import (
    AffineFormat,
    EncodedLatentCache,
    EncodedRowState,
    LatentGeometry,
    MLACache,
    PrefillPadding,
    TurboFormat,
)
from kvshelf.latent_legos.encodings.family import family_encoding

G = LatentGeometry(kv_lora_rank=128, rope_head_dim=64, index_head_dim=64)
FORMATS = [AffineFormat(8, 64), TurboFormat(8, 3)]


def inputs(batch: int, length: int, seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((batch, length, w)).astype(np.float32)) for w in G.widths]


def reads_of(state) -> list[mx.array]:
    return [state.latent, state.rope, state.index_keys]


def encoded_reads(fmt, f32_reads) -> list[mx.array]:
    """What converted storage reads: each family's positions through the encoding and back."""
    return [family_encoding(fmt, w).decode(family_encoding(fmt, w).encode(r)) for w, r in zip(G.widths, f32_reads)]


def same_bits(xs, ys) -> bool:
    return all(np.array_equal(bits(x), bits(y)) for x, y in zip(xs, ys))


@pytest.mark.parametrize("fmt", FORMATS, ids=["affine8", "turbo-k8"])
def test_start_zero_reads_the_first_append_in_f32_then_converts(fmt):
    cache, mla = EncodedLatentCache(G, fmt, 0), MLACache(G)
    first = cache.append_latent(*inputs(1, 7, 1))
    assert same_bits(reads_of(first), reads_of(mla.append_latent(*inputs(1, 7, 1))))
    assert cache.converted == [True] and cache.minimum_reusable_offset == 0
    assert len(cache.state) == 9  # planes only: the shadow went with the last unconverted row
    second = cache.append_latent(*inputs(1, 1, 2))
    reference = reads_of(mla.append_latent(*inputs(1, 1, 2)))
    assert same_bits(reads_of(second), encoded_reads(fmt, reference))
    assert not same_bits(reads_of(second), reference)
    assert cache.signature() == f"kv:latent:dsa:{'affine:8:64' if isinstance(fmt, AffineFormat) else 'turbo:8:3'}:0"


@pytest.mark.parametrize("fmt", FORMATS, ids=["affine8", "turbo-k8"])
def test_start_512_converts_at_562_and_stays_converted(fmt):
    cache, mla = EncodedLatentCache(G, fmt, 512), MLACache(G)
    for step, length in enumerate((7, 1, 1, 1, 300, 1, 1, 250)):
        chunk = inputs(1, length, step)
        got, want = cache.append_latent(*chunk), mla.append_latent(*chunk)
        assert same_bits(reads_of(got), reads_of(want)), f"read after {cache.offset} positions is not f32"
        assert cache.converted == [cache.offset >= 512]
    assert cache.offset == 562 and cache.minimum_reusable_offset == 562
    assert len(cache.state) == 9
    after = reads_of(cache.append_latent(*inputs(1, 1, 99)))
    expected = encoded_reads(fmt, reads_of(mla.append_latent(*inputs(1, 1, 99))))
    assert same_bits(after, expected)
    cache.trim(100)  # below start: still converted, and the floor stays
    assert cache.offset == 463 and cache.converted == [True] and cache.minimum_reusable_offset == 562
    mla.trim(100)
    chunk = inputs(1, 2, 7)
    assert same_bits(reads_of(cache.append_latent(*chunk)), encoded_reads(fmt, reads_of(mla.append_latent(*chunk))))
    state = cache.row_state(0)
    assert state.shadow is None and state.offset == 465 and state.minimum_reusable_offset == 562


def test_rows_convert_on_their_own_and_the_shadow_goes_with_the_last():
    fmt = AffineFormat(8, 64)
    long, short = EncodedLatentCache(G, fmt, 5), EncodedLatentCache(G, fmt, 5)
    long.append_latent(*inputs(1, 6, 1))
    short.append_latent(*inputs(1, 2, 2))
    assert long.converted == [True] and long.minimum_reusable_offset == 6
    batch = long.make_empty_batch()
    batch.merge_rows([long, short])
    assert batch.converted == [True, False] and len(batch.state) == 12
    mla = MLACache(G)
    mla.merge_rows([_mla_row(1, 6), _mla_row(2, 2)])
    chunk = inputs(2, 3, 3)
    read, f32 = reads_of(batch.append_latent(*chunk)), reads_of(mla.append_latent(*chunk))
    encoded = encoded_reads(fmt, f32)
    assert same_bits([r[:1] for r in read], [e[:1] for e in encoded])  # the converted row reads decoded
    assert same_bits([r[1:] for r in read], [x[1:] for x in f32])  # the other read f32 through its crossing
    assert batch.converted == [True, True] and len(batch.state) == 9
    assert batch.row_state(1).minimum_reusable_offset == 5 and batch.minimum_reusable_offset == 6


def _mla_row(seed: int, length: int) -> MLACache:
    cache = MLACache(G)
    cache.append_latent(*inputs(1, length, seed))
    return cache


def test_row_state_restore_and_filter_keep_the_shadow_rules():
    fmt = TurboFormat(8, 3)
    cache = EncodedLatentCache(G, fmt, 4)
    cache.append_latent(*inputs(2, 3, 1))
    state = cache.row_state(1)
    assert isinstance(state, EncodedRowState) and state.offset == 3 and state.shadow is not None
    assert [len(group) for group in state.planes] == [3, 3, 3]
    assert [tuple(s.shape) for s in state.shadow] == [(1, 3, 128), (1, 3, 64), (1, 3, 64)]
    restored = cache.make_empty_batch()
    restored.restore_row(state)
    assert same_bits(reads_of(restored.read_latent()), [r[1:] for r in reads_of(cache.read_latent())])
    assert restored.converted == [False]
    converted = EncodedLatentCache(G, fmt, 0)
    converted.append_latent(*inputs(1, 2, 5))
    converted_state = converted.row_state(0)
    assert converted_state.shadow is None
    mixed = cache.make_empty_batch()
    with pytest.raises(InvalidCacheState):  # another start is another signature
        mixed.merge_rows([cache, converted])
    mixed.merge_row_states([converted_state, state])
    assert mixed.converted == [True, False] and mixed.left_pad == [1, 0]
    shadow_of_converted = np.array(mixed.state[-3])[0]
    assert np.all(shadow_of_converted == 0.0)
    mixed.filter_rows([0])
    assert mixed.converted == [True] and len(mixed.state) == 9 and mixed.offset == 2
    bad = EncodedRowState([g[:2] for g in state.planes], state.shadow, 3, 0)
    with pytest.raises(InvalidCacheState):
        cache.make_empty_batch().restore_row(bad)
    wrong_dtype = EncodedRowState([[g[0].astype(mx.uint8), *g[1:]] for g in state.planes], None, 3, 0)
    with pytest.raises(InvalidCacheState):
        cache.make_empty_batch().restore_row(wrong_dtype)


def test_prefill_padding_covers_planes_and_shadow():
    fmt = AffineFormat(8, 64)
    cache, mla = EncodedLatentCache(G, fmt, 100), MLACache(G)
    padding = PrefillPadding([5, 4], left_padding=[2, 0], right_padding=[0, 1])
    chunk = inputs(2, 5, 4)
    for c in (cache, mla):
        c.prepare_prefill(padding)
    assert same_bits(reads_of(cache.append_latent(*chunk)), reads_of(mla.append_latent(*chunk)))
    for c in (cache, mla):
        c.finalize_prefill()
    assert (cache.offset, cache.row_offsets, cache.left_pad) == (4, [3, 4], [1, 0])
    assert same_bits(reads_of(cache.read_latent()), reads_of(mla.read_latent()))
    assert all(tuple(a.shape[:2]) == (2, 4) for a in cache.state)
    converted = EncodedLatentCache(G, fmt, 0)
    converted.prepare_prefill(padding)
    converted.append_latent(*chunk)
    converted.finalize_prefill()
    assert converted.converted == [True, True]
    read = reads_of(converted.read_latent())
    assert same_bits(read, encoded_reads(fmt, reads_of(mla.read_latent())))
    assert all(np.all(np.array(r)[0, 0] == 0.0) for r in read)


def test_accounting_and_the_minimum_setter():
    fmt = AffineFormat(8, 64)
    cache = EncodedLatentCache(G, fmt, 0)
    per_token = sum(p.nbytes for w in G.widths for p in family_encoding(fmt, w).encode(mx.zeros((1, 1, w))))
    assert cache.bytes_per_token() == per_token and cache.projected_bytes(3) == 3 * 4 * 256
    cache.minimum_reusable_offset = 4
    cache.append_latent(*inputs(3, 2, 1))
    assert cache.minimum_reusable_offset == 4 and cache.row_state(2).minimum_reusable_offset == 4
    cache.minimum_reusable_offset = 1
    assert cache.minimum_reusable_offset == 1
    with pytest.raises(InvalidCacheState):
        EncodedLatentCache(G, fmt, -1)
    with pytest.raises(InvalidCacheState):
        EncodedLatentCache(G, None, 0)
    with pytest.raises(InvalidCacheState):
        EncodedLatentCache(LatentGeometry(96, 64), fmt, 0)  # 96 is no multiple of the group size
    cache.dispose()
    assert (cache.batch_size, cache.state, cache.minimum_reusable_offset) == (None, [], 0)
