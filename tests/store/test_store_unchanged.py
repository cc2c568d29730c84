"""Skip-unchanged hashing (issue 11): a grown session's save hashes only what it cannot prove unchanged since the
session's last save, and reusing a hash never changes what is stored.

The proof is the cache's edit epoch (``kvshelf_epoch``) plus the store's memory of the last save (same objects,
same epochs, windows below the old offset, identical descriptors, still the current snapshot). These tests count
the hashing work through ``store.counters`` and check, after random edits of every kind kvshelf's caches make in
place (trim, rollback, trim-and-regrow with other values, buffer assignment, row merge/filter round trips, whole
contents replaced, encoded rows converting), that every snapshot restores bit-exact and that its manifest names
exactly the chunks a from-scratch hashing of the same content names.
"""

from __future__ import annotations

import gc
import tempfile
import weakref

import mlx.core as mx
import pytest
from codec_cases import GEOMETRY, append
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_cases import kv, raw
from store_cases import open_test_store

from kvshelf.codecs import default_provider
from kvshelf.latent_legos import AffineFormat, EncodedLatentCache, MLACache, TurboFormat
from kvshelf.latent_legos.contracts import EditEpoch, edit_epoch
from kvshelf.latent_legos.kv import KVCache, QuantizedKVCache, TurboQuantKVCache
from kvshelf.store.objects.chunkfile import content_hash
from kvshelf.store.save.chunking import cuts, plan_chunks
from kvshelf.store.save.hash_reuse import UnchangedBook

KV_DIMS = dict(heads=2, dk=64, dv=64, dtype=mx.float16)
KINDS = {
    "kv": KVCache,
    "qkv8": lambda: QuantizedKVCache(group_size=64, bits=8),
    "turbo83": lambda: TurboQuantKVCache(8, 3),
    "mla": lambda: MLACache(GEOMETRY),
    "affine8-start10": lambda: EncodedLatentCache(GEOMETRY, AffineFormat(8, 32), start=10),
    "turbo-start0": lambda: EncodedLatentCache(GEOMETRY, TurboFormat(8, 3), start=0),
}
HASH_COUNTERS = ("chunks_hashed", "bytes_hashed", "chunks_hash_reused", "bytes_hash_reused")


def grow(cache, n: int, seed: int) -> None:
    """Append ``n`` positions of data determined by ``seed``."""
    if isinstance(cache, (MLACache, EncodedLatentCache)):
        append(cache, n, seed)
    else:
        cache.update_and_fetch(*kv(1, n, seed, **KV_DIMS))


def session(kind: str, n: int, seed: int, layers: int = 2) -> list:
    caches = [KINDS[kind]() for _ in range(layers)]
    for i, c in enumerate(caches):
        if n:
            grow(c, n, seed * 100 + i)
    return caches


def offset_of(caches) -> int:
    return int(caches[0].offset) if caches[0].batch_size is not None else 0


def snap(caches):
    """Entries and evaluated arrays of the caches as a save captures them."""
    out = [default_provider.snapshot(c, checksums=False) for c in caches]
    mx.eval([a for _, arrs in out for a in arrs])
    return [e for e, _ in out], [list(a) for _, a in out]


def content(entries, arrays) -> list:
    return [(e.kind, e.offset, e.minimum_reusable_offset, [(s.name, s.dtype, tuple(s.shape)) for s in e.tensors],
             [raw(a).tobytes() for a in arrs]) for e, arrs in zip(entries, arrays)]


def scratch_hashes(entries, arrays, chunk_tokens: int, windows=()) -> list[str]:
    """The chunk names of this content hashed from scratch, cut at ``windows`` (a manifest's), in manifest order
    (token chunks, then the own one)."""
    return [content_hash(plan.pieces) for plan in plan_chunks(entries, arrays, chunk_tokens, windows)]


def manifest_hashes(store, snapshot_id: str) -> list[str]:
    m = store.admin.manifest(snapshot_id)
    return [r.hash for r in m.chunks] + [r.hash for r in m.own]


def check_saved(store, info, expected) -> None:
    entries, arrays = expected
    got = store.restore_snapshot(info.snapshot_id)
    assert content(*snap(got.caches)) == content(entries, arrays)
    windows = [(r.start, r.stop) for r in store.admin.manifest(info.snapshot_id).chunks]
    assert manifest_hashes(store, info.snapshot_id) == scratch_hashes(entries, arrays, store.chunk_tokens, windows)


def counts(store) -> dict[str, int]:
    return {k: store.counters[k] for k in HASH_COUNTERS}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in HASH_COUNTERS}


# -- counting the work ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["kv", "mla"])
def test_grown_session_hashes_only_the_new_chunk(tmp_path, kind):
    caches = session(kind, 4096, 1)
    with open_test_store(tmp_path / "s", chunk_tokens=256) as store:
        first = counts(store)
        store.save("chat", list(range(4096)), caches)
        saved = counts(store)
        assert delta(first, saved)["chunks_hashed"] == 16 and delta(first, saved)["chunks_hash_reused"] == 0
        for c in caches:
            grow(c, 256, 77)
        expected = snap(caches)
        info = store.save("chat", list(range(4352)), caches)
        d = delta(saved, counts(store))
        assert d["chunks_hashed"] == 1 and d["chunks_hash_reused"] == 16
        assert d["bytes_hashed"] * 16 == d["bytes_hash_reused"]  # one chunk's bytes vs sixteen
        assert info.chunks_written == 1
        check_saved(store, info, expected)


def test_window_straddling_the_old_offset_is_hashed(tmp_path):
    caches = session("kv", 4100, 2)
    with open_test_store(tmp_path / "s", chunk_tokens=256) as store:
        store.save("chat", list(range(4100)), caches)
        for c in caches:
            grow(c, 100, 5)
        before = counts(store)
        expected = snap(caches)
        info = store.save("chat", list(range(4200)), caches)
        d = delta(before, counts(store))
        assert d["chunks_hashed"] == 1 and d["chunks_hash_reused"] == 16  # [4096, 4200) straddles 4100
        check_saved(store, info, expected)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_reuses_after_appends_only(tmp_path, kind):
    caches = session(kind, 13, 3)
    with open_test_store(tmp_path / "s") as store:  # 4-token chunks
        store.save("s", list(range(13)), caches)
        stored = cuts(13, 4)
        for step in range(3):
            for i, c in enumerate(caches):
                grow(c, 5, 40 + 10 * step + i)
            before = counts(store)
            expected = snap(caches)
            n = offset_of(caches)
            info = store.save("s", list(range(n)), caches)
            d = delta(before, counts(store))
            # every window the last save stored is kept (cut where it was cut) and proven unchanged
            assert d["chunks_hash_reused"] == len(stored), d
            stored = cuts(n, 4, stored)
            check_saved(store, info, expected)


def test_mlx_lm_kv_cache_is_always_hashed(tmp_path):
    from mlx_lm.models import cache as cache_mod  # the test extra: mlx-lm is always there
    caches = [cache_mod.KVCache() for _ in range(2)]
    for i, c in enumerate(caches):
        c.update_and_fetch(*kv(1, 4096, 900 + i, **KV_DIMS))
    with open_test_store(tmp_path / "s", chunk_tokens=256) as store:
        store.save("chat", list(range(4096)), caches)
        for i, c in enumerate(caches):
            c.update_and_fetch(*kv(1, 256, 950 + i, **KV_DIMS))
        before = counts(store)
        store.save("chat", list(range(4352)), caches)
        d = delta(before, counts(store))
        assert d["chunks_hashed"] == 17 and d["chunks_hash_reused"] == 0
        # one mlx-lm layer among kvshelf layers is enough to hash every window that layer has pieces in
        mixed = [caches[0], *session("kv", 4352, 4, layers=1)]
        store.save("mixed", list(range(4352)), mixed)
        for c in mixed:
            c.update_and_fetch(*kv(1, 256, 990, **KV_DIMS))
        before = counts(store)
        store.save("mixed", list(range(4608)), mixed)
        assert delta(before, counts(store))["chunks_hash_reused"] == 0
    assert edit_epoch(caches[0]) is None and not isinstance(caches[0], EditEpoch)


# -- the epoch itself ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_epoch_moves_on_trim_and_not_on_append(kind):
    cache = session(kind, 9, 6, layers=1)[0]
    assert isinstance(cache, EditEpoch)
    e0 = edit_epoch(cache)
    grow(cache, 3, 61)
    assert edit_epoch(cache) == e0 or kind == "affine8-start10"  # that one converts at 10: its shadow leaves
    e1 = edit_epoch(cache)
    cache.trim(2)
    assert edit_epoch(cache) != e1


def test_trim_and_regrow_below_the_stored_offset_is_saved(tmp_path):
    """Fails if ``trim`` does not bump the epoch: same object, same offset, only the last window's bytes differ."""
    for kind in ("kv", "mla"):
        caches = session(kind, 16, 8)
        with open_test_store(tmp_path / kind) as store:
            store.save("s", list(range(16)), caches)
            for i, c in enumerate(caches):
                c.trim(3)
                grow(c, 3, 500 + i)  # other values in [13, 16)
            expected = snap(caches)
            info = store.save("s", list(range(16)), caches)
            check_saved(store, info, expected)


def test_a_replaced_current_snapshot_is_hashed_again(tmp_path):
    caches = session("kv", 20, 9)
    with open_test_store(tmp_path / "s") as store, open_test_store(tmp_path / "s") as other:
        store.save("s", list(range(20)), caches)
        other.save("s", list(range(20)), caches)  # the session's current snapshot is no longer store's
        for c in caches:
            grow(c, 4, 3)
        before = counts(store)
        store.save("s", list(range(24)), caches)
        assert delta(before, counts(store))["chunks_hash_reused"] == 0


def test_memory_is_bounded_and_holds_no_cache(tmp_path):
    book = UnchangedBook(capacity=3)
    for i in range(5):
        book.put(("", f"s{i}"), object())
    assert len(book) == 3 and book.get(("", "s0")) is None and book.get(("", "s4")) is not None
    caches = session("mla", 10, 1)
    refs = [weakref.ref(c) for c in caches]
    with open_test_store(tmp_path / "s") as store:
        store.save("s", list(range(10)), caches)
        del caches
        gc.collect()
        assert all(r() is None for r in refs)


# -- reuse never changes the outcome (hypothesis) --------------------------------------------------------------------

APPEND = st.tuples(st.just("append"), st.integers(1, 7))
EDIT = st.one_of(  # each may change stored positions in place (appends and saves come in between)
    st.tuples(st.just("trim"), st.integers(1, 7)),
    st.tuples(st.just("regrow"), st.integers(1, 7), st.integers(0, 7)),  # trim-and-regrow, every layer
    st.tuples(st.just("regrow-one"), st.integers(1, 6), st.integers(0, 1)),  # one layer, same offset
    st.tuples(st.just("rollback"), st.integers(1, 6), st.integers(0, 6)),
    st.tuples(st.just("floor"), st.integers(0, 1)),
    st.tuples(st.just("keys"), st.integers(0, 1)),
    st.tuples(st.just("batch"), st.integers(0, 1)),
    st.tuples(st.just("replace"), st.integers(0, 1)),
)
# a step: an append or an edit, then no save (None), a save (False) or a save_async (True)
STEPS = st.lists(st.tuples(st.one_of(APPEND, EDIT), st.one_of(st.none(), st.booleans())), min_size=1, max_size=12)


def apply(caches, op, seed: int) -> None:
    name = op[0]
    n = offset_of(caches)
    if name == "append":
        for i, c in enumerate(caches):
            grow(c, op[1], seed + i)
    elif name == "trim":
        for c in caches:
            c.trim(min(op[1], n))
    elif name == "regrow":
        back = min(op[1], n)
        for i, c in enumerate(caches):
            c.trim(back)
            if op[2]:
                grow(c, op[2], seed + i)
    elif name == "regrow-one":
        back = min(op[1], n)
        if back:
            c = caches[op[2]]
            c.trim(back)
            grow(c, back, seed)
    elif name == "rollback":
        for i, c in enumerate(caches):
            c.spec_round_begin()
            grow(c, op[1], seed + i)
            c.spec_round_rollback(min(op[2], op[1]))
    elif name == "floor":
        caches[op[1]].minimum_reusable_offset = n // 2
    elif name == "keys" and isinstance(caches[0], KVCache) and n:
        c = caches[op[1]]
        c.keys = c.keys * 2  # every stored key changes, same buffer shape
    elif name == "batch" and n:  # rows join and leave: the same object ends serial again, its row moved
        c = caches[op[1]]
        other = session_like(c, n + 2, seed)
        if isinstance(c, (KVCache, QuantizedKVCache, TurboQuantKVCache)):
            c.extend(other)
            c.filter([0])
        else:
            mine = c.extract_row(0)
            c.dispose()
            c.merge_rows([other, mine])
            c.filter_rows([1])
    elif name == "replace" and n:  # whole contents replaced in place by another cache's (same length)
        c = caches[op[1]]
        other = session_like(c, n, seed)
        c.dispose()
        c.merge_rows([other])


def session_like(cache, n: int, seed: int):
    other = cache.make_empty_batch()
    if n:
        grow(other, n, seed)
    return other


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start=st.integers(0, 14), steps=STEPS, budget=st.booleans())
def test_reuse_never_changes_what_is_stored(kind, start, steps, budget):
    caches = session(kind, start, 11)
    pending = []
    with tempfile.TemporaryDirectory() as d:
        with open_test_store(d, max_bytes=(1 << 30) if budget else None) as store:
            def settle():
                store.flush()
                for fut, expected in pending:
                    check_saved(store, fut.result(), expected)
                pending.clear()

            def save(asynchronous: bool) -> None:
                settle()
                n = offset_of(caches)
                expected = snap(caches)
                if asynchronous:  # the next steps edit the caches while the write is pending
                    pending.append((store.save_async("s", list(range(n)), caches), expected))
                else:
                    check_saved(store, store.save("s", list(range(n)), caches), expected)

            save(False)
            for k, (op, then) in enumerate(steps):
                apply(caches, op, 1000 + 37 * k)
                if then is not None:
                    save(then)
            save(False)
