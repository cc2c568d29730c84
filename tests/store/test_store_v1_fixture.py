"""A store written by layout v1 (one file per chunk, one manifest file per snapshot: ``tests/data/v1_store``, made by
``tests/data/make_v1_store.py`` with the v1 code) opens, lists, restores bit-exact and verifies clean under the
current code; new saves into it work; compaction rewrites its v1 chunks and it restores bit-exact again."""

from __future__ import annotations

import shutil

import pytest

from v1_fixture import EXPECTED, FIXTURE, IDENTITY, state_checksum
from kvshelf import open_store  # noqa: E402


@pytest.fixture
def v1_store(tmp_path):
    """A private copy of the committed fixture (the committed one is never opened for writing)."""
    root = tmp_path / "v1"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("lock.mdb"))
    return root


def check_all(store) -> None:
    for name, want in EXPECTED["sessions"].items():
        got = store.restore(name)
        assert got.tokens == want["tokens"], name
        assert [state_checksum(c) for c in got.caches] == want["checksums"], name


def test_v1_store_opens_lists_restores_bit_exact_and_verifies_clean(v1_store):
    with open_store(v1_store, identity=IDENTITY, chunk_tokens=EXPECTED["chunk_tokens"]) as store:
        assert sorted(s.session_id for s in store.sessions()) == sorted(EXPECTED["sessions"])
        assert store.admin.chunk_info(EXPECTED["zstd_chunk"]).encoding == "zstd"
        check_all(store)
        assert store.verify(deep=True) == []
        hit = store.lookup(EXPECTED["sessions"]["share-b"]["tokens"][:10] + [1, 2])
        assert hit is not None and hit.length == 10
        assert store.restore_prefix(EXPECTED["sessions"]["share-b"]["tokens"][:10] + [1, 2]).length == 10


def test_v1_store_takes_new_saves_beside_old_ones(v1_store):
    with open_store(v1_store, identity=IDENTITY, chunk_tokens=EXPECTED["chunk_tokens"]) as store:
        old = store.restore("share-b")
        info = store.save("share-c", old.tokens, old.caches)
        assert info.chunks_reused > 0  # the same content hashes as the v1 chunks: deduplicated against them
        again = store.restore("share-c")
        assert [state_checksum(c) for c in again.caches] == EXPECTED["sessions"]["share-b"]["checksums"]
        check_all(store)
        assert store.verify(deep=True) == []


def test_v1_store_compacts_into_packs_and_restores_bit_exact_again(v1_store):
    from kvshelf.tools.compaction import compact

    with open_store(v1_store, admin=True) as store:
        assert all(not meta.pack for _h, meta in store.admin.iter_chunks())  # every chunk a v1 blob file
        n = len(list(store.admin.iter_chunks()))
        report = compact(store, cold_after=1e10, grace=0.0, merge=False, densify_pages=False)
        # nothing is cold (1e10 s), but the fixture's hot zstd chunk stays zstd: decompressing it would make the
        # store bigger before anything was given back (compaction never ends bigger); every chunk is repacked
        assert report.step("decompress").count == 0 and report.step("repack").count == n
        assert report.bytes_after <= report.bytes_before
        assert all(meta.pack for _h, meta in store.admin.iter_chunks())  # every chunk now lies in a pack
        assert all(s.pack for s in store.admin.summaries().values())  # manifests moved out of the v1 files too
        assert not list((v1_store / "blobs").glob("??/*.*"))  # no v1 chunk file left
        assert not list((v1_store / "blobs" / "manifests").glob("*.msgpack"))
        assert store.verify(deep=True) == []
    with open_store(v1_store, identity=IDENTITY, chunk_tokens=EXPECTED["chunk_tokens"]) as store:
        check_all(store)
        assert store.verify(deep=True) == []
    with open_store(v1_store, admin=True) as store:  # and the packs alone rebuild the same store
        assert store.rebuild_index() == len(EXPECTED["sessions"])
    with open_store(v1_store, identity=IDENTITY, chunk_tokens=EXPECTED["chunk_tokens"]) as store:
        check_all(store)
        assert store.verify(deep=True) == []
