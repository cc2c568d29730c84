"""Re-encoding a chunk is invisible to readers (issue 12): the interleaving "reader found the chunk's location ->
re-encoding moves it and removes the old form -> reader opens" is forced through the test seam
``kvshelf.store.base.seams.BEFORE_OPEN`` (called between a reader's location lookup and its open), never left to timing.

Before issue 12, ``rewrite_chunk`` unlinked the other encoding without the writer lock and a reader in that window saw
``FileNotFoundError``, took it for corruption and quarantined a healthy snapshot.
"""

from __future__ import annotations

import os

import pytest
from tools_data import MODEL, make_caches, same_reads

from kvshelf import open_store
from kvshelf.store.base import seams

N = 40


@pytest.fixture
def hook():
    hooks = seams.BEFORE_OPEN
    yield hooks
    hooks.clear()


def test_an_unleased_reader_follows_a_chunk_moved_between_lookup_and_open(tmp_path, hook) -> None:
    caches = make_caches("mla", N, 3, layers=1)
    with open_store(tmp_path / "s", identity=MODEL, chunk_tokens=16) as store:
        info = store.save("a", list(range(N)), caches)
        h = store.admin.manifest(info.snapshot_id).chunks[0].hash
        assert store.admin.rewrite_chunk(h, "zstd") is not None  # now alone in a one-chunk pack (no manifest in it)
        old = store.admin.chunk_location(h)[0]
        moved = []

        def reencode(name: str) -> None:
            if name == old and not moved:  # once: the reader has the old location in hand
                moved.append(None)  # (the rewrite's own read passes through here too)
                moved[0] = store.admin.rewrite_chunk(h, "raw")
                assert not os.path.exists(tmp_path / "s" / old), "the old form must be gone for this test"

        hook.append(reencode)
        with store.admin.open_chunk(h, verify=True) as reader:  # what verify(deep=True) and compaction use
            reader.read_into([None] * len(reader.tensors))
        assert moved and moved[0] is not None and store.admin.chunk_location(h)[0] != old
        assert store.verify(deep=True) == []
        assert store.stats()["quarantined_sessions"] == 0
        hook.clear()
        assert same_reads(store.restore("a").caches, caches)


def test_a_leased_restore_is_never_re_encoded_under_it(tmp_path, hook) -> None:
    """The restore path holds a lease from location lookup to the last read: a re-encoding attempted in the window
    is skipped (re-checked in its write transaction), and the restore is exact."""
    caches = make_caches("mla", N, 4, layers=1)
    with open_store(tmp_path / "s", identity=MODEL, chunk_tokens=16) as store:
        info = store.save("a", list(range(N)), caches)
        hashes = [r.hash for r in store.admin.manifest(info.snapshot_id).chunks]
        for h in hashes:
            store.admin.rewrite_chunk(h, "zstd")
        tried = []

        def reencode(name: str) -> None:
            if not tried:
                tried.append("busy")  # (the rewrite's own reads pass through here too)
                tried[:] = [store.admin.rewrite_chunk(h, "raw") for h in hashes]

        hook.append(reencode)
        r = store.restore("a")
        assert tried == [None] * len(hashes)  # every chunk was leased: left where it was
        assert same_reads(r.caches, caches)
        assert store.stats()["quarantined_sessions"] == 0 and store.verify(deep=True) == []


def test_a_restore_retries_when_its_chunks_moved_and_only_calls_a_real_loss_corrupt(tmp_path, hook) -> None:
    """Even if the old form vanished under a restore (a lease file unreadable at the rewrite's check), the reader
    re-reads the locations and reads the new form; a chunk object removed without a move is still corruption."""
    caches = make_caches("mla", N, 5, layers=1)
    with open_store(tmp_path / "s", identity=MODEL, chunk_tokens=16) as store, \
            open_store(tmp_path / "s", identity=MODEL, chunk_tokens=16) as other:
        info = store.save("a", list(range(N)), caches)
        h = store.admin.manifest(info.snapshot_id).chunks[0].hash
        store.admin.rewrite_chunk(h, "zstd")
        old = store.admin.chunk_location(h)[0]
        done = []

        def vanish(name: str) -> None:
            if name == old and not done:
                # the worst case: the chunk is moved and its old form unlinked while this restore holds a lease
                # naming it (as a rewrite that could not read the lease file would) - done by hand, by the index
                done.append(1)
                store.leases.close()  # the reader's lease file is gone from the other handle's view
                try:
                    assert other.admin.rewrite_chunk(h, "raw") is not None
                finally:
                    store.leases = type(store.leases)(store.root)
                if os.path.exists(tmp_path / "s" / old):
                    os.unlink(tmp_path / "s" / old)

        hook.append(vanish)
        r = store.restore("a")
        assert done and same_reads(r.caches, caches)
        assert store.stats()["quarantined_sessions"] == 0
        hook.clear()
        os.unlink(tmp_path / "s" / store.admin.chunk_location(h)[0])  # really lost: not moved, gone
        from kvshelf.errors import CorruptData

        with pytest.raises(CorruptData):
            store.restore("a")
