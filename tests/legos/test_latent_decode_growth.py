"""Decode-speed storage of the latent legos (issue 14), counted in bytes, never in time.

* An append's storage work (what it allocates or copies, read through MLX's peak-memory counter, and what capacity
  growth copied, read from the legos' own counter) is bounded by a constant times the appended positions plus the
  amortised growth, and does not depend on how many positions are already stored.
* Snapshots taken after many single-position appends are byte-identical to snapshots of a cache built by one long
  append of the same data, for every latent lego (f32, affine, turbo, paged, with and without the shadow of an
  unconverted row and a nonzero ``quantized_kv_start``), also after trims and batched rows.
* Reads and ``state`` never show spare capacity; the optional read buffer reads the bits of a whole decode.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from bit_exact import bits
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.codecs import default_provider, encode_entry
from kvshelf.errors import InvalidCacheState
from kvshelf.latent_legos import (
    AffineFormat,
    EncodedLatentCache,
    LatentGeometry,
    MLACache,
    PagedLatentCache,
    TurboFormat,
)
from kvshelf.latent_legos.latent.columns import GROWTH_DIVISOR, MIN_STEP
from kvshelf.latent_legos.contracts import PrefillPadding

G = LatentGeometry(kv_lora_rank=128, rope_head_dim=64, index_head_dim=64)
G_PLAIN = LatentGeometry(kv_lora_rank=128, rope_head_dim=64)
KiB = 1 << 10


def families(geometry: LatentGeometry, batch: int, length: int, seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    out = [mx.array(rng.standard_normal((batch, length, w)).astype(np.float32)) for w in geometry.widths]
    mx.eval(out)
    return out


LEGOS = {
    "mla": lambda g: MLACache(g),
    "encoded-affine8": lambda g: EncodedLatentCache(g, AffineFormat(8, 64)),
    "encoded-affine4-start": lambda g: EncodedLatentCache(g, AffineFormat(4, 32), start=6),
    "encoded-turbo8": lambda g: EncodedLatentCache(g, TurboFormat(8, 3)),
    "encoded-turbo3-shadow": lambda g: EncodedLatentCache(g, TurboFormat(3, 3), start=10_000),
    "encoded-affine8-buffer": lambda g: EncodedLatentCache(g, AffineFormat(8, 64), read_buffer=True),
    "paged-f32": lambda g: PagedLatentCache(g, None, 16),
    "paged-affine8": lambda g: PagedLatentCache(g, AffineFormat(8, 64), 16),
    "paged-turbo8": lambda g: PagedLatentCache(g, TurboFormat(8, 3), 16),
}


def snapshot_bytes(cache) -> tuple[bytes, list[bytes]]:
    entry, arrays = default_provider.for_cache(cache).snapshot(cache)
    return encode_entry(entry), [np.array(a).tobytes() for a in arrays]


def append_singles(cache, data: list[mx.array], start: int = 0) -> None:
    for t in range(start, data[0].shape[1]):
        cache.append_latent(*[d[:, t : t + 1, :] for d in data])


def append_long(cache, data: list[mx.array]) -> None:
    """``data`` in as few appends as keep the conversion point: a cache converting at a nonzero
    ``quantized_kv_start`` records the offset it converted at as its floor, so the long build splits there."""
    start = getattr(cache, "start", 0)
    if 0 < start < data[0].shape[1]:
        cache.append_latent(*[d[:, :start, :] for d in data])
        cache.append_latent(*[d[:, start:, :] for d in data])
    else:
        cache.append_latent(*data)


# -- snapshots: many single appends == one long append ------------------------------------------------------------


@pytest.mark.parametrize("geometry", [G, G_PLAIN], ids=["dsa", "plain"])
@pytest.mark.parametrize("kind", LEGOS)
def test_single_appends_snapshot_like_one_long_append(kind, geometry):
    data = families(geometry, 1, 90, seed=1)
    whole = LEGOS[kind](geometry)
    append_long(whole, data)
    singles = LEGOS[kind](geometry)
    append_singles(singles, data)
    assert snapshot_bytes(singles) == snapshot_bytes(whole)
    # a prefill then decode steps, as a serving process stores them (conversion at quantized_kv_start included)
    stepped = LEGOS[kind](geometry)
    stepped.append_latent(*[d[:, :6, :] for d in data])
    append_singles(stepped, data, start=6)
    want = LEGOS[kind](geometry)
    want.append_latent(*[d[:, :6, :] for d in data])
    want.append_latent(*[d[:, 6:, :] for d in data])
    assert snapshot_bytes(stepped) == snapshot_bytes(want)
    for a, b in zip(singles.read_latent().latent, whole.read_latent().latent):
        assert np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize("kind", LEGOS)
def test_trim_and_rewrite_in_place_snapshot_like_a_fresh_cache(kind):
    data = families(G, 1, 70, seed=2)
    other = families(G, 1, 70, seed=3)
    cache = LEGOS[kind](G)
    append_singles(cache, data)
    assert cache.trim(20) == 20
    cache.spec_round_begin()
    append_singles(cache, other, start=50)  # rewrites the trimmed columns in place
    cache.spec_round_rollback(12)
    mixed = [mx.concatenate([d[:, :50], o[:, 50:62]], axis=1) for d, o in zip(data, other)]
    fresh = LEGOS[kind](G)
    append_long(fresh, [m[:, :50] for m in mixed])
    fresh.append_latent(*[m[:, 50:] for m in mixed])
    if kind.startswith("paged"):  # pages keep stale bytes in freed blocks, so compare what they read
        for a, b in zip((cache.read_latent().latent, cache.read_latent().rope),
                        (fresh.read_latent().latent, fresh.read_latent().rope)):
            assert np.array_equal(bits(a), bits(b))
    else:
        assert snapshot_bytes(cache) == snapshot_bytes(fresh)


@pytest.mark.parametrize("kind", LEGOS)
def test_batched_single_appends_extract_like_one_long_append(kind):
    data = families(G, 2, 40, seed=4)
    whole, singles = LEGOS[kind](G), LEGOS[kind](G)
    append_long(whole, data)
    append_singles(singles, data)
    for row in range(2):
        assert snapshot_bytes(singles.extract_row(row)) == snapshot_bytes(whole.extract_row(row))
    singles.filter_rows([1])  # a relayout drops the capacity; later appends grow it again
    whole.filter_rows([1])
    more = families(G, 1, 30, seed=5)
    append_singles(singles, more)
    whole.append_latent(*more)
    assert snapshot_bytes(singles) == snapshot_bytes(whole)


# -- no spare capacity is ever exposed ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [k for k in LEGOS if not k.startswith("paged")])
def test_state_and_row_state_show_only_stored_positions(kind):
    cache = LEGOS[kind](G)
    append_singles(cache, families(G, 1, 37, seed=6))
    assert cache.nbytes > sum(a.nbytes for a in cache.state)  # there is spare capacity ...
    assert all(a.shape[1] == 37 for a in cache.state)  # ... and nothing shows it
    state = cache.row_state(0)
    arrays = state.arrays if kind == "mla" else [p for group in state.planes for p in group] + (state.shadow or [])
    assert all(a.shape[1] == 37 for a in arrays)
    read = cache.read_latent()
    assert read.latent.shape == (1, 37, 128) and read.index_keys.shape == (1, 37, 64)


def test_encoded_memory_stays_within_a_sixteenth_of_the_planes():
    for fmt in (AffineFormat(8, 64), TurboFormat(8, 3)):
        cache = EncodedLatentCache(G_PLAIN, fmt)
        cache.append_latent(*families(G_PLAIN, 1, 2048, seed=7))
        append_singles(cache, families(G_PLAIN, 1, 300, seed=8))
        planes = cache.offset * cache.bytes_per_token()
        assert planes <= cache.nbytes <= planes * (1 + 1 / GROWTH_DIVISOR) + MIN_STEP * cache.bytes_per_token()


def test_read_buffer_reads_the_bits_of_a_whole_decode():
    data = families(G, 2, 60, seed=9)
    for fmt in (AffineFormat(8, 64), AffineFormat(4, 32), TurboFormat(8, 3), TurboFormat(3, 3)):
        plain, buffered = EncodedLatentCache(G, fmt), EncodedLatentCache(G, fmt, read_buffer=True)
        for cache in (plain, buffered):
            cache.append_latent(*[d[:, :20] for d in data])
        for t in range(20, 60):
            step = [d[:, t : t + 1] for d in data]
            a, b = plain.append_latent(*step), buffered.append_latent(*step)
            if t % 7 == 0:
                plain.trim(2), buffered.trim(2)
                a, b = plain.read_latent(), buffered.read_latent()
            for x, y in zip((a.latent, a.rope, a.index_keys), (b.latent, b.rope, b.index_keys)):
                assert np.array_equal(bits(x), bits(y))
        plain.filter_rows([1]), buffered.filter_rows([1])
        for x, y in zip((plain.read_latent().latent,), (buffered.read_latent().latent,)):
            assert np.array_equal(bits(x), bits(y))
        assert buffered.make_empty_batch().read_buffer is True
        assert buffered.nbytes > plain.nbytes  # the buffer costs its float32 reads
    with pytest.raises(InvalidCacheState, match="read_buffer"):
        EncodedLatentCache(G, AffineFormat(8, 64), read_buffer="yes")


# -- the bytes an append allocates or copies --------------------------------------------------------------------


def _step_peak(cache, step: list[mx.array], read_too: bool) -> int:
    """Bytes above the live set one append (and, if ``read_too``, its read) needed while evaluated."""
    mx.eval(cache.state)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    read = cache.append_latent(*step)
    mx.eval(cache.state)
    if read_too:
        mx.eval(read.latent, read.rope)
    del read
    return mx.get_peak_memory() - base


def _capacity(cache) -> int:
    if isinstance(cache, PagedLatentCache):
        return sum(p.num_blocks for p in cache.pages)
    return cache.nbytes


# (lego, whether its read costs O(1) too: views of the stored prefix, or the read buffer)
BOUNDED = {
    "mla": True,
    "paged-f32": True,
    "encoded-affine8-buffer": True,
    "encoded-turbo8": False,
    "paged-turbo8": False,
}


@pytest.mark.parametrize("kind", BOUNDED)
def test_append_bytes_do_not_grow_with_the_stored_length(kind):
    per_position = G_PLAIN.f32_bytes_per_token()
    bound = 64 * KiB  # a few new positions plus MLX's small temporaries
    for stored in (256, 16_384):  # 64x apart: a whole-cache copy at 16k is ~12 MiB
        cache = LEGOS[kind](G_PLAIN)
        cache.append_latent(*families(G_PLAIN, 1, stored, seed=10))
        steps = [families(G_PLAIN, 1, 1, seed=11 + i) for i in range(48)]
        peaks = []
        for step in steps:
            before = _capacity(cache)
            peak = _step_peak(cache, step, BOUNDED[kind])
            if _capacity(cache) == before:  # no growth this step
                peaks.append(peak)
        assert len(peaks) >= 40, (kind, stored, len(peaks))
        assert max(peaks) <= bound, (kind, stored, sorted(peaks)[-3:])
    assert cache.offset * per_position > 100 * bound  # the bound is far below one copy of the cache


@pytest.mark.parametrize("kind", ["mla", "encoded-affine8", "encoded-affine8-buffer"])
def test_growth_copies_amortise_to_a_constant_per_appended_position(kind):
    for stored in (300, 6000):
        cache = LEGOS[kind](G_PLAIN)
        cache.append_latent(*families(G_PLAIN, 1, stored, seed=12))
        buffers = [cache._columns] if kind == "mla" else [cache._planes]
        start = sum(b.copied_bytes for b in buffers)
        appended = stored  # double the cache one position at a time
        chunk = families(G_PLAIN, 1, appended, seed=13)
        append_singles(cache, chunk)
        copied = sum(b.copied_bytes for b in buffers) - start
        assert copied > 0  # it did grow, one copy per ~w/16 appends
        stored_bytes = cache.bytes_per_token() if kind != "mla" else G_PLAIN.f32_bytes_per_token()
        # each growth copies w columns and buys at least max(64, w/16) appends: at most ~17 columns per append
        assert copied <= (GROWTH_DIVISOR + 2) * appended * stored_bytes, (kind, stored, copied)


# -- the read buffer follows every row operation --------------------------------------------------------------------


@settings(max_examples=25)
@given(data=st.data(), fmt=st.sampled_from([AffineFormat(8, 64), TurboFormat(4, 3)]), start=st.sampled_from([0, 5]))
def test_read_buffer_reads_what_the_plain_lego_reads_through_any_operations(data, fmt, start):
    plain, buffered = EncodedLatentCache(G, fmt, start), EncodedLatentCache(G, fmt, start, read_buffer=True)
    caches = (plain, buffered)
    batch = data.draw(st.integers(1, 3))
    seed = 100
    if data.draw(st.booleans()):
        left = data.draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch))
        for cache in caches:
            cache.prepare_prefill(PrefillPadding([4] * batch, left_padding=left))
        chunk = families(G, batch, 4, seed)
        for cache in caches:
            cache.append_latent(*chunk)
            cache.finalize_prefill()

    def same() -> None:
        a, b = plain.read_latent(), buffered.read_latent()
        for x, y in zip((a.latent, a.rope, a.index_keys), (b.latent, b.rope, b.index_keys)):
            assert np.array_equal(bits(x), bits(y))

    for _ in range(data.draw(st.integers(3, 12))):
        seed += 1
        op = data.draw(st.sampled_from(["append", "append", "append", "trim", "round", "filter"]))
        rows = plain.batch_size or batch
        if op == "append" or plain.batch_size is None:
            chunk = families(G, rows, data.draw(st.integers(1, 3)), seed)
            reads = [cache.append_latent(*chunk) for cache in caches]
            assert np.array_equal(bits(reads[0].latent), bits(reads[1].latent))
        elif op == "trim":
            n = data.draw(st.integers(0, min(plain.row_offsets)))
            assert plain.trim(n) == buffered.trim(n)
        elif op == "round":
            for cache in caches:
                cache.spec_round_begin()
            chunk = families(G, rows, 3, seed)
            for cache in caches:
                cache.append_latent(*chunk)
            keep = data.draw(st.lists(st.integers(0, 3), min_size=rows, max_size=rows))
            for cache in caches:
                cache.spec_round_rollback(keep)
        elif rows > 1:
            keep = data.draw(st.permutations(range(rows)))[: data.draw(st.integers(1, rows))]
            for cache in caches:
                cache.filter_rows(list(keep))
        same()


@pytest.mark.parametrize("fmt", [AffineFormat(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64)]
                         + [TurboFormat(k, 3) for k in (2, 3, 4, 5, 8)], ids=str)
def test_short_appends_encode_the_families_jointly_to_the_same_bits(fmt):
    from kvshelf.latent_legos.latent.family_codec import JOINT_MAX_POSITIONS, FamilyCodec

    codec = FamilyCodec(G.widths, fmt)
    long = JOINT_MAX_POSITIONS + 44
    data = families(G, 2, long, seed=20)
    data[1] = data[1] * 50  # families of very different scales share no group
    alone = codec.encode(data)  # longer than the joint limit: each family on its own
    chunks = [codec.encode([d[:, a : a + 100] for d in data]) for a in range(0, long, 100)]
    joint = [mx.concatenate([c[i] for c in chunks], axis=1) for i in range(len(alone))]
    for a, b in zip(alone, joint):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array(a).tobytes() == np.array(b).tobytes()
