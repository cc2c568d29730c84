"""Rows and prefixes: batched caches are refused, extracted rows round-trip, ``load_batch`` equals loading each
row and ``merge_rows``, and ``prefix_entry`` + load equals load + trim."""

from __future__ import annotations

import mlx.core as mx
import pytest
from codec_cases import CASES_BY_ID, Case, all_cases, append, describe, filled, read_bits

from kvshelf.codecs import default_provider
from kvshelf.errors import CacheRangeError, InvalidCacheState

CASES = all_cases()
SOME = [CASES_BY_ID[i] for i in ("mla-f32-dsa", "encoded-affine4-nodsa-unconverted", "encoded-turbo8-dsa-converted",
                                 "paged-f32-nodsa", "paged-turbo4-dsa")]


def batched(case: Case):
    """Two rows of different lengths (5+3 and 7) merged into one batched cache."""
    rows = [filled(case, lengths=(5, 3), seed=0), filled(case, lengths=(7,), seed=50)]
    cache = case.make().make_empty_batch()
    cache.merge_rows(rows)
    return cache, rows


def cut(entry, arrays, p):
    """What the store hands back for a prefix: each tensor cut to ``p`` along its token axis, others whole."""
    out = []
    for slot, array in zip(entry.tensors, arrays):
        if slot.token_axis is None:
            out.append(array)
        else:
            index = [slice(None)] * array.ndim
            index[slot.token_axis] = slice(0, p)
            out.append(array[tuple(index)])
    return out


def same_future(a, b, batch: int = 1) -> None:
    assert describe(a) == describe(b)
    assert read_bits(append(a, 3, 200, batch)) == read_bits(append(b, 3, 200, batch))
    assert a.trim(1) == b.trim(1)
    assert read_bits(append(a, 2, 201, batch)) == read_bits(append(b, 2, 201, batch))
    assert describe(a) == describe(b)


@pytest.mark.parametrize("case", SOME, ids=[c.id for c in SOME])
def test_batched_cache_is_refused_with_directions(case):
    cache, _ = batched(case)
    before = describe(cache)
    with pytest.raises(InvalidCacheState, match=r"holds 2 rows; call extract_row\(i\) for each of the 2 rows"):
        default_provider.snapshot(cache)
    assert describe(cache) == before


@pytest.mark.parametrize("case", SOME, ids=[c.id for c in SOME])
def test_each_extracted_row_round_trips(case):
    cache, rows = batched(case)
    for i in range(2):
        row = cache.extract_row(i)
        entry, arrays = default_provider.snapshot(row)
        assert entry.offset == rows[i].offset
        loaded = default_provider.load(entry, arrays)
        same_future(cache.extract_row(i), loaded)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_load_batch_equals_load_each_and_merge_rows(case):
    rows = [filled(case, lengths=(5, 3), seed=0), filled(case, lengths=(2,), seed=30), filled(case, lengths=(6,), seed=60)]
    snaps = [default_provider.snapshot(r) for r in rows]
    codec = default_provider.for_entry(snaps[0][0])
    direct = codec.load_batch([e for e, _ in snaps], [a for _, a in snaps])
    merged = case.make().make_empty_batch()
    merged.merge_rows([codec.load(e, a) for e, a in snaps])
    assert direct.batch_size == 3 and direct.row_offsets == [8, 2, 6]
    same_future(direct, merged, batch=3)


def test_load_batch_refuses_mixed_layouts():
    a = default_provider.snapshot(filled(CASES_BY_ID["encoded-affine4-nodsa-converted"]))
    b = default_provider.snapshot(filled(CASES_BY_ID["encoded-affine8-nodsa-converted"]))
    codec = default_provider.for_entry(a[0])
    with pytest.raises(InvalidCacheState, match="row 1 has bits=8 but row 0 has 4"):
        codec.load_batch([a[0], b[0]], [a[1], b[1]])
    with pytest.raises(InvalidCacheState, match="2 entries but 1 array lists"):
        codec.load_batch([a[0], a[0]], [a[1]])
    with pytest.raises(InvalidCacheState, match="at least one row"):
        codec.load_batch([], [])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_prefix_entry_then_load_equals_load_then_trim(case):
    cache = filled(case, lengths=(5, 4))  # 9 positions; encoded-converted has floor 5
    entry, arrays = default_provider.snapshot(cache)
    codec = default_provider.for_entry(entry)
    for p in sorted({entry.minimum_reusable_offset, 5, 8, 9} | ({4, 1, 0} if entry.minimum_reusable_offset == 0 else set())):
        prefix = codec.prefix_entry(entry, p)
        assert prefix.offset == p and all(slot.checksum == "" for slot in prefix.tensors)
        for slot, full in zip(prefix.tensors, entry.tensors):
            if slot.token_axis is not None:
                assert slot.shape[slot.token_axis] == p and slot.nbytes == full.nbytes // 9 * p
            else:
                assert slot.shape == full.shape and slot.nbytes == full.nbytes
        if case.lego == "paged":
            assert prefix.pages.block_table == entry.pages.block_table[: -(-p // 4)]
        from_prefix = codec.load(prefix, cut(entry, arrays, p))
        trimmed = codec.load(entry, arrays)
        trimmed.trim(9 - p)
        same_future(trimmed, from_prefix)


def test_prefix_entry_refuses_positions_outside_the_usable_range():
    cache = filled(CASES_BY_ID["encoded-affine4-nodsa-converted"], lengths=(5, 4))
    entry, _ = default_provider.snapshot(cache)
    codec = default_provider.for_entry(entry)
    assert entry.minimum_reusable_offset == 5
    with pytest.raises(CacheRangeError, match="below the entry's minimum_reusable_offset 5"):
        codec.prefix_entry(entry, 4)
    with pytest.raises(CacheRangeError, match=r"outside \[0, 9\]"):
        codec.prefix_entry(entry, 10)
    assert all(default_provider.for_entry(k).header_trimmable(entry) for k in ("mla", "latent-encoded", "latent-paged"))


def test_floor_above_a_rolled_back_offset_is_capped_at_the_offset():
    cache = CASES_BY_ID["encoded-affine4-nodsa-converted"].make()  # start 3
    append(cache, 2, 0)
    cache.spec_round_begin()
    append(cache, 4, 1)  # crosses the start: converted at 6, floor 6
    cache.spec_round_rollback(1)  # back to 3 positions, floor stays 6
    assert (cache.offset, cache.minimum_reusable_offset) == (3, 6)
    entry, arrays = default_provider.snapshot(cache)
    assert (entry.offset, entry.minimum_reusable_offset, entry.shadow) == (3, 3, False)
    loaded = default_provider.load(entry, arrays)
    assert loaded.minimum_reusable_offset == 3
    assert read_bits(append(loaded, 2, 9)) == read_bits(append(cache, 2, 9))


def test_store_style_arrays_without_checksums_load(tmp_path):
    import msgspec

    cache = filled(CASES_BY_ID["paged-affine8-dsa"])
    entry, arrays = default_provider.snapshot(cache)
    bare = msgspec.structs.replace(
        entry, tensors=[msgspec.structs.replace(s, checksum="") for s in entry.tensors]
    )
    loaded = default_provider.load(bare, [mx.array(a) for a in arrays])
    assert describe(loaded) == describe(cache)
