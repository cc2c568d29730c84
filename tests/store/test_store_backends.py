"""The store runs on any ByteStore and any IndexStore: the same save / restore / prefix / delete / verify / gc /
rebuild sequence on every pairing of the local directory or memory (bytes) with LMDB or memory (index) — the seams
the shared tier plugs into, and proof that ``Store`` speaks only their protocols."""

from __future__ import annotations

import pytest
from codec_cases import CASES_BY_ID
from store_cases import open_test_store, same_caches, session, token_ids

from kvshelf.store import LocalByteStore, MemoryByteStore
from kvshelf.store.index.memory import MemoryIndexStore

MLA = CASES_BY_ID["mla-f32-nodsa"]
BACKENDS = {
    "local": lambda root: LocalByteStore(str(root), str(root / "tmp")),
    "memory": lambda root: MemoryByteStore(),
}


INDEXES = {"lmdb": lambda: None, "memory": MemoryIndexStore}


@pytest.mark.parametrize("index", sorted(INDEXES))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_the_store_on_every_byte_store(tmp_path, backend, index):
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    objects = BACKENDS[backend](root)
    shared = token_ids(40)
    with open_test_store(root, chunk_tokens=16, byte_store=objects, index_store=INDEXES[index]()) as store:
        store.save("a", shared + token_ids(8, seed=1), session(MLA, (40, 8)))
        store.save("b", shared + token_ids(20, seed=2), session(MLA, (40, 20), seed=0))
        assert sorted(n for n in objects.names("packs/")) == sorted({store.admin.chunk_location(h)[0]
                                                                    for h, _m in store.admin.iter_chunks()})
        same_caches(store.restore("a").caches, session(MLA, (40, 8)))
        assert store.restore_prefix(shared + [1]).length == 40
        store.delete("a")
        assert store.verify(deep=True) == []
        assert store.gc(dry_run=False).orphan_objects == []
        assert (root / "index").exists() == (index == "lmdb")  # a memory index leaves no file behind
    if index == "lmdb":
        for name in ("data.mdb", "lock.mdb"):
            (root / "index" / name).unlink()
    with open_test_store(root, chunk_tokens=16, byte_store=objects, index_store=INDEXES[index]()) as store:
        assert store.rebuild_index() == 1  # b only: a's tombstone keeps it out
        same_caches(store.restore("b").caches, session(MLA, (40, 20), seed=0))
        assert [s.session_id for s in store.sessions()] == ["b"]
        assert store.verify(deep=True) == []


def test_a_memory_index_outlives_its_store_handle_and_bad_seams_are_refused(tmp_path):
    """The index is the caller's object: a second handle on the same ``MemoryIndexStore`` and byte store sees what
    the first saved (the shape a shared index takes); an object that is not an ``IndexStore`` is refused."""
    from kvshelf.errors import WrongArgumentType

    index, objects = MemoryIndexStore(), MemoryByteStore()
    tokens = token_ids(30)
    with open_test_store(tmp_path / "s", byte_store=objects, index_store=index) as store:
        store.save("a", tokens, session(MLA, (30,)))
    with open_test_store(tmp_path / "s", byte_store=objects, index_store=index) as store:
        same_caches(store.restore("a").caches, session(MLA, (30,)))
        assert store.lookup(tokens + [7]).session_id == "a"
        assert store.verify(deep=True) == []
    with pytest.raises(WrongArgumentType):
        open_test_store(tmp_path / "t", index_store={"not": "an index"})
