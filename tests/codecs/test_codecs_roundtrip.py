"""Every latent lego x format x DSA x converted/unconverted x paged/unpaged survives a snapshot bit for bit.

"Bit for bit" means: the loaded cache's signature, offsets, floor, held arrays and stored index keys equal the
original's, and the next appends, trims and speculative rollbacks give byte-identical reads on both.
"""

from __future__ import annotations

import pytest
from codec_cases import Case, all_cases, append, bits, describe, filled, read_bits

from kvshelf.codecs import default_provider, load_snapshot, save_snapshot
from kvshelf.codecs.kinds.encoded import EncodedCodec
from kvshelf.codecs.kinds.mla import MLACodec
from kvshelf.codecs.kinds.paged import PagedCodec

CASES = all_cases()


def restore(cache, how: str, tmp_path):
    if how == "memory":
        codec = default_provider.for_cache(cache)
        entry, arrays = codec.snapshot(cache)
        return default_provider.for_entry(entry.kind).load(entry, arrays)
    path = tmp_path / "snap.safetensors"
    save_snapshot(path, list(range(cache.offset)), [cache])
    snap = load_snapshot(path)
    assert snap.tokens == list(range(cache.offset))
    return snap.caches[0]


def assert_same_future(a, b) -> None:
    """Drive both caches through the same appends, trims and rollbacks; every read and state must agree."""
    assert describe(a) == describe(b)
    assert read_bits(append(a, 3, 100)) == read_bits(append(b, 3, 100))
    assert describe(a) == describe(b)
    assert a.trim(2) == b.trim(2)
    assert describe(a) == describe(b)
    assert read_bits(append(a, 1, 101)) == read_bits(append(b, 1, 101))
    for cache in (a, b):
        cache.spec_round_begin()
    assert read_bits(append(a, 4, 102)) == read_bits(append(b, 4, 102))
    for cache in (a, b):
        cache.spec_round_rollback(1)
    assert describe(a) == describe(b)
    assert read_bits(append(a, 2, 103)) == read_bits(append(b, 2, 103))
    assert describe(a) == describe(b)


@pytest.mark.parametrize("how", ["memory", "file"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_round_trip_is_bit_identical(case: Case, how: str, tmp_path):
    original = filled(case)
    before = describe(original)
    loaded = restore(original, how, tmp_path)
    assert describe(original) == before  # snapshotting changed nothing
    assert type(loaded) is type(original)
    assert loaded.batch_size == 1 and loaded.offset == 8
    assert_same_future(original, loaded)


def test_matrix_covers_every_kind():
    kinds = {default_provider.for_cache(c.make()).kind for c in CASES}
    assert kinds == {"mla", "mla-dsa", "latent-encoded", "latent-paged"}
    assert len(CASES) == 2 * (1 + 5 + 4 * 2)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_entry_describes_the_cache(case: Case):
    cache = filled(case)
    entry, arrays = default_provider.snapshot(cache)
    assert entry.offset == 8
    assert entry.kv_lora_rank == 64 and entry.rope_head_dim == 32
    assert entry.index_head_dim == (32 if case.dsa else None)
    assert len(arrays) == len(entry.tensors)
    for slot, array in zip(entry.tensors, arrays):
        assert list(array.shape) == slot.shape and slot.nbytes == array.nbytes and len(slot.checksum) == 32
        if case.lego == "paged":
            assert slot.token_axis is None and slot.shape[1] == case.block_size
        else:
            assert slot.token_axis == 1 and slot.shape[:2] == [1, 8]
    if case.lego == "encoded":
        assert entry.shadow is (not case.converted)
        assert entry.quantized_kv_start == (3 if case.converted else 40)
        # converted at the first append (5 positions) with a nonzero start: the floor is 5
        assert entry.minimum_reusable_offset == (5 if case.converted else 0)
        families = 3 if case.dsa else 2
        assert len(entry.tensors) == 3 * families + (0 if case.converted else families)
        assert [s.name for s in entry.tensors][:3] == ["latent.0", "latent.1", "latent.2"]
    if case.lego == "paged":
        assert entry.pages.block_size == 4 and entry.pages.block_table == [0, 1]
        assert entry.pages.num_blocks == cache.pages[0].num_blocks == 2


@pytest.mark.parametrize("lego", ["mla", "encoded", "paged"])
@pytest.mark.parametrize("how", ["memory", "file"])
def test_empty_cache_round_trips_at_offset_zero(lego, how, tmp_path):
    case = Case(lego, "f32" if lego != "encoded" else "affine4", True, False)
    original = case.make()
    entry, _ = default_provider.snapshot(original)
    assert entry.offset == 0 and all(0 in slot.shape for slot in entry.tensors)
    loaded = restore(original, how, tmp_path)
    assert loaded.offset == 0
    assert read_bits(append(original, 6, 7)) == read_bits(append(loaded, 6, 7))
    assert describe(original) == describe(loaded)


def test_paged_restore_rebuilds_the_free_list(tmp_path):
    cache = filled(Case("paged", "affine4", False, False), lengths=(9, 6))  # 15 positions: 4 blocks of 4
    cache.trim(7)  # 8 positions: blocks 2 and 3 return to the free list
    free = cache.pages[0].free_list
    assert free and cache.pages[0].block_table == [0, 1]
    loaded = restore(cache, "file", tmp_path)
    assert loaded.pages[0].free_list == free
    assert loaded.pages[0].num_blocks == cache.pages[0].num_blocks
    append(cache, 5, 1)
    append(loaded, 5, 1)
    assert loaded.pages[0].block_table == cache.pages[0].block_table
    assert [bits(p) for p in loaded.pages[0].pools] == [bits(p) for p in cache.pages[0].pools]


def test_codecs_claim_their_kinds():
    assert default_provider.id == "kvshelf-cache-v1"
    assert set(default_provider.kinds) == {
        "mla", "mla-dsa", "latent-encoded", "latent-paged",  # latent legos
        "kv", "qkv", "turboquant", "rotating", "arrays",  # key/value legos
    }
    assert isinstance(default_provider.for_entry("mla"), MLACodec)
    assert isinstance(default_provider.for_entry("latent-encoded"), EncodedCodec)
    assert isinstance(default_provider.for_entry("latent-paged"), PagedCodec)
    for case in CASES:
        assert default_provider.for_entry(default_provider.for_cache(case.make()).kind).matches(case.make())
