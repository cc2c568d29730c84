"""``restore_batch`` reads rows straight into the batched layout: equal to restore each + ``merge_rows``, bit-exact.

Every kind with a codec ``batch_plan`` (MLA ±DSA, encoded affine/turbo converted, unconverted and mixed, the
token-axis key/value kinds) must take the direct path (the store's ``batch_layers_direct`` counter, and no
``load_batch``/``merge_row_states`` call at all for MLA); paged, rotating and arrays caches go through ``load_batch``.
"""

from __future__ import annotations

import os

import pytest
from codec_cases import (
    FORMATS,
    Case,
    all_cases,
    append,
    bits,
    describe,
    filled,
    read_bits,
)
from kv_cases import MAKERS, flat, kv, same
from store_cases import flip_chunk_byte, open_test_store, token_ids

from kvshelf import Identity, open_store
from kvshelf.codecs.kinds.mla import MLACodec
from kvshelf.errors import CorruptData, InvalidCacheState, SnapshotNotFound
from kvshelf.latent_legos import EncodedLatentCache, MLACache
from kvshelf.latent_legos.kv import ArraysCache, RotatingKVCache

LAYERS = 2
LATENT = all_cases()


class MixedCase(Case):
    """Encoded rows with start 8: rows shorter than 8 stay unconverted (shadow), longer ones convert."""

    def make(self):
        return EncodedLatentCache(self.geometry(), FORMATS[self.fmt], 8)


MIXED = [MixedCase("encoded", fmt, dsa, False) for fmt in ("affine4", "turbo8") for dsa in (False, True)]


def latent_session(case: Case, lengths, seed: int) -> list:
    return [filled(case, lengths=lengths, seed=seed + 100 * layer) for layer in range(LAYERS)]


def reference(store, requests, layer: int):
    """Each request restored on its own, then merged with ``merge_rows``."""
    rows = []
    for req in requests:
        if isinstance(req, str):
            rows.append(store.restore(req).caches[layer])
        else:
            rows.append(store.restore_snapshot(req.snapshot_id, req.length).caches[layer])
    merged = rows[0].make_empty_batch()
    merged.merge_rows(rows)
    return merged


def latent_observed(cache) -> tuple:
    return (*describe(cache), getattr(cache, "converted", None))


def assert_same_latent(got, want) -> None:
    """State, bookkeeping, then the next append's reads, a speculative rollback's reads, and a trim."""
    assert latent_observed(got) == latent_observed(want)
    rows = got.batch_size
    assert read_bits(append(got, 2, 500, rows)) == read_bits(append(want, 2, 500, rows))
    for c in (got, want):
        c.spec_round_begin()
    assert read_bits(append(got, 3, 501, rows)) == read_bits(append(want, 3, 501, rows))
    keep = [k % 4 for k in range(rows)]
    got.spec_round_rollback(keep)
    want.spec_round_rollback(keep)
    assert latent_observed(got) == latent_observed(want)
    assert read_bits(got.read_latent()) == read_bits(want.read_latent())
    assert got.trim(1) == want.trim(1)
    assert latent_observed(got) == latent_observed(want)


def counts(store) -> tuple[int, int]:
    return store.counters["batch_layers_direct"], store.counters["batch_layers_fallback"]


@pytest.mark.parametrize("case", LATENT + MIXED, ids=[c.id for c in LATENT] + [f"mixed-{c.id}" for c in MIXED])
def test_latent_batches_equal_restore_each_and_merge(tmp_path, case):
    a, b, c = token_ids(14, 1), token_ids(6, 2), token_ids(11, 3)
    with open_test_store(tmp_path / "s") as store:
        store.save("a", a, latent_session(case, (9, 5), 10))
        store.save("b", b, latent_session(case, (4, 2), 20))
        store.save("c", c, latent_session(case, (11,), 30))
        floor = store.restore("a").caches[0].minimum_reusable_offset
        hit_a = store.lookup(a[: max(7, floor)] + [70_000])  # a cut inside a chunk (chunk_tokens 4)
        hit_c = store.lookup(c[:9] + [70_001])  # None where c's floor is above 9 (converted at 11)
        requests = ["b", hit_a, "a", "c"] + ([hit_c] if hit_c is not None else [])
        lengths = [6, hit_a.length, 14, 11] + ([hit_c.length] if hit_c is not None else [])
        direct = case.lego != "paged"
        before = counts(store)
        batch = store.restore_batch(requests)
        assert counts(store) == (before[0] + LAYERS * direct, before[1] + LAYERS * (not direct))
        assert batch.lengths == lengths
        if isinstance(case, MixedCase):  # row b (6 tokens) unconverted, the others converted
            assert batch.caches[0].converted == [False, True, True, True] + ([True] if hit_c is not None else [])
        for layer, cache in enumerate(batch.caches):
            assert cache.row_offsets == lengths and cache.left_pad == [14 - n for n in lengths]
            assert_same_latent(cache, reference(store, requests, layer))


def test_mla_batch_builds_no_per_row_arrays(tmp_path, monkeypatch):
    """The direct path never calls ``load_batch`` nor ``merge_row_states``: rows land in one array per tensor."""
    case = Case("mla", "f32", True, False)
    with open_test_store(tmp_path / "s", chunk_tokens=8) as store:
        store.save("x", token_ids(30, 1), latent_session(case, (30,), 1))
        store.save("y", token_ids(17, 2), latent_session(case, (17,), 2))
        want = [reference(store, ["x", "y", "x"], layer) for layer in range(LAYERS)]

        def refuse(*args, **kwargs):
            raise AssertionError("the direct batch path built per-row state")

        monkeypatch.setattr(MLACodec, "load_batch", refuse)
        monkeypatch.setattr(MLACache, "merge_row_states", refuse)
        before = dict(store.counters)
        batch = store.restore_batch(["x", "y", "x"])
        assert store.counters["batch_layers_direct"] - before["batch_layers_direct"] == LAYERS
        assert store.counters["batch_layers_fallback"] == before["batch_layers_fallback"]
        assert store.counters["chunks_read"] - before["chunks_read"] == 4 + 3 + 4
        for got, ref in zip(batch.caches, want):
            assert describe(got) == describe(ref)
            assert [tuple(a.shape) for a in got.state] == [(3, 30, w) for w in case.geometry().widths]


def kv_layers(kind: str, n: int, seed: int) -> list:
    out = []
    for layer in range(LAYERS):
        cache = MAKERS[kind]()
        cache.update_and_fetch(*kv(1, n, seed + layer))
        out.append(cache)
    return out


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_kv_batches_equal_restore_each_and_merge(tmp_path, kind):
    long_tokens, short_tokens, mid_tokens = list(range(300)), list(range(500, 509)), list(range(900, 925))
    with open_store(tmp_path / "s", identity=Identity("kv-model"), chunk_tokens=16) as store:
        store.save("long", long_tokens, kv_layers(kind, 300, 0))
        store.save("short", short_tokens, kv_layers(kind, 9, 10))
        store.save("mid", mid_tokens, kv_layers(kind, 25, 20))
        store.save("empty", [], [MAKERS[kind]() for _ in range(LAYERS)])
        hit = store.lookup(long_tokens[:21] + [9999])
        requests = ["short", hit, "long", "empty", "mid"]
        before = counts(store)
        batch = store.restore_batch(requests)
        assert counts(store) == (before[0] + LAYERS, before[1])
        for layer, cache in enumerate(batch.caches):
            want = reference(store, requests, layer)
            assert cache.row_offsets == [9, 21, 300, 0, 25] == want.row_offsets
            assert cache.left_pad == want.left_pad and cache.offset == want.offset == 300
            assert cache.minimum_reusable_offset == want.minimum_reusable_offset
            assert same(cache.state, want.state)  # capacity included
            assert same(flat(cache.keys_and_values()), flat(want.keys_and_values()))
            assert same(flat(cache.update_and_fetch(*kv(5, 2, 77))), flat(want.update_and_fetch(*kv(5, 2, 77))))
            for c in (cache, want):
                c.spec_round_begin()
                c.update_and_fetch(*kv(5, 3, 78))
                c.spec_round_rollback([0, 1, 2, 3, 1])
            assert same(flat(cache.keys_and_values()), flat(want.keys_and_values()))
            assert cache.row_offsets == want.row_offsets and same(cache.state, want.state)


def test_kv_rows_of_different_heads_are_refused_as_load_batch_refuses(tmp_path):
    with open_store(tmp_path / "s", identity=Identity("kv-model"), chunk_tokens=16) as store:
        two = MAKERS["kv"]()
        two.update_and_fetch(*kv(1, 5, 1, heads=2))
        four = MAKERS["kv"]()
        four.update_and_fetch(*kv(1, 5, 2, heads=4))
        store.save("two", list(range(5)), [two])
        store.save("four", list(range(10, 15)), [four])
        with pytest.raises(InvalidCacheState) as direct:
            store.restore_batch(["two", "four"])
        assert store.counters["batch_layers_fallback"] == 0 and store.counters["batch_layers_direct"] == 0
        assert "plane" in str(direct.value) and store.admin.leased_hashes() == set()
        assert store.restore("two").caches[0].row_offsets == [5]


def test_untokened_kinds_take_load_batch(tmp_path):
    def layers(seed):
        ring = RotatingKVCache(64, 2)
        ring.update_and_fetch(*kv(1, 12, seed, dv=32))
        arrays = ArraysCache(2)
        arrays[0] = kv(1, 1, seed + 1)[0]
        arrays.advance(12)
        return [ring, arrays]

    with open_store(tmp_path / "s", identity=Identity("kv-model"), chunk_tokens=16) as store:
        store.save("a", list(range(12)), layers(1))
        store.save("b", list(range(50, 62)), layers(2))
        batch = store.restore_batch(["a", "b"])
        assert counts(store) == (0, 2)
        ring_rows = [store.restore(s).caches[0] for s in ("a", "b")]
        merged = ring_rows[0].make_empty_batch()
        merged.merge_rows(ring_rows)
        assert same(batch.caches[0].state, merged.state) and batch.caches[1].batch_size == 2


def test_corrupt_chunk_in_one_row_raises_and_returns_nothing(tmp_path):
    case = Case("encoded", "affine4", False, False)
    with open_test_store(tmp_path / "s") as store:
        store.save("good", token_ids(12, 1), latent_session(case, (12,), 1))
        store.save("bad", token_ids(10, 2), latent_session(case, (10,), 2))
        bad = store.admin.manifest(store.sessions()[[s.session_id for s in store.sessions()].index("bad")].snapshot_id)
        ref = bad.chunks[1]
        flip_chunk_byte(store, ref.hash, from_end=7, bit=0x10)
        result = None
        with pytest.raises(CorruptData) as raised:
            result = store.restore_batch(["good", "bad", "good"])
        assert result is None
        assert "'bad'" in str(raised.value) and ref.hash in str(raised.value) and "[4, 8)" in str(raised.value)
        assert store.admin.leased_hashes() == set()
        with pytest.raises(CorruptData, match="quarantined"):
            store.restore("bad")
        good = store.restore_batch(["good", "good"])
        assert good.caches[0].row_offsets == [12, 12]
        assert bits(good.caches[0].state[0]) == bits(reference(store, ["good", "good"], 0).state[0])
        with pytest.raises((CorruptData, SnapshotNotFound)):
            store.restore_batch(["good", "bad"])
