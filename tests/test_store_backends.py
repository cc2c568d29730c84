"""The store runs on any ByteStore: the same save / restore / prefix / delete / verify / gc / rebuild sequence on the
local directory and on the in-memory implementation (the seam the shared tier plugs into)."""

from __future__ import annotations

import pytest
from codec_cases import CASES_BY_ID
from store_cases import open_test_store, same_caches, session, token_ids

from kvshelf.store import LocalByteStore, MemoryByteStore

MLA = CASES_BY_ID["mla-f32-nodsa"]
BACKENDS = {
    "local": lambda root: LocalByteStore(str(root), str(root / "tmp")),
    "memory": lambda root: MemoryByteStore(),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_the_store_on_every_byte_store(tmp_path, backend):
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    objects = BACKENDS[backend](root)
    shared = token_ids(40)
    with open_test_store(root, chunk_tokens=16, byte_store=objects) as store:
        store.save("a", shared + token_ids(8, seed=1), session(MLA, (40, 8)))
        store.save("b", shared + token_ids(20, seed=2), session(MLA, (40, 20), seed=0))
        assert sorted(n for n in objects.names("packs/")) == sorted({store.chunk_location(h)[0]
                                                                    for h, _m in store.iter_chunks()})
        same_caches(store.restore("a").caches, session(MLA, (40, 8)))
        assert store.restore_prefix(shared + [1]).length == 40
        store.delete("a")
        assert store.verify(deep=True) == []
        assert store.gc(dry_run=False).orphan_blobs == []
    for name in ("data.mdb", "lock.mdb"):
        (root / "index" / name).unlink()
    with open_test_store(root, chunk_tokens=16, byte_store=objects) as store:
        assert store.rebuild_index() == 1  # b only: a's tombstone keeps it out
        same_caches(store.restore("b").caches, session(MLA, (40, 20), seed=0))
        assert [s.session_id for s in store.sessions()] == ["b"]
        assert store.verify(deep=True) == []
