"""A damaged chunk is never reused: the restore that finds it marks the copy bad in the transaction that quarantines
the snapshot, the next save of the same content writes fresh bytes and takes the chunk's name back (healing every
other session that used the copy), and a copy nobody re-saves is reported by ``verify`` with the sessions it
affects until ``repair`` drops them."""

from __future__ import annotations

from store_cases import flip_chunk_byte
from tools_data import MODEL, make_caches

from kvshelf import open_store
from kvshelf.errors import CorruptData
from bit_exact import snapshot_state

N = 48


def _bits(caches) -> list:
    return [[a.tobytes() for a in snapshot_state(c)] for c in caches]


def _three_sharing(root):
    """Sessions a, b, c holding the same content (every chunk shared), one chunk of it flipped."""
    store = open_store(root, identity=MODEL, chunk_tokens=16)
    infos = [store.save(s, list(range(N)), make_caches("mla", N, 1)) for s in "abc"]
    bad = store.manifest(infos[0].snapshot_id).chunks[1].hash
    flip_chunk_byte(store, bad)
    return store, bad


def test_a_resave_heals_every_session_that_used_the_damaged_copy(tmp_path) -> None:
    store, bad = _three_sharing(tmp_path / "s")
    want = _bits(make_caches("mla", N, 1))
    with store:
        try:
            store.restore("a")
            raise AssertionError("a damaged chunk restored")
        except CorruptData:
            pass
        kinds = {(f.kind, f.where): f.sessions for f in store.verify()}
        assert kinds[("bad-chunk", f"blob {bad}")] == ("b", "c")  # reported with the sessions it affects
        info = store.save("a", list(range(N)), make_caches("mla", N, 1))
        assert info.blobs_written == 1 and info.bytes_written > 0  # a fresh copy of the bad chunk, nothing more
        for s in "abc":
            assert _bits(store.restore(s).caches) == want
        assert store.verify(deep=True) == []  # the re-save cleared a's quarantine; the damaged copy was reclaimed


def test_a_save_never_dedupes_onto_a_bad_copy_across_handles(tmp_path) -> None:
    root = tmp_path / "s"
    store, bad = _three_sharing(root)
    with store:
        try:
            store.restore("b")
        except CorruptData:
            pass
    with open_store(root, identity=MODEL, chunk_tokens=16) as again:  # a restart: the mark is in the index
        info = again.save("d", list(range(N)), make_caches("mla", N, 1))
        assert info.blobs_written == 1
        assert _bits(again.restore("a").caches) == _bits(make_caches("mla", N, 1))
        assert [f.kind for f in again.verify(deep=True)] == ["quarantined"]
