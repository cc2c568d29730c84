"""The project's index stores run the shipped conformance suite (``kvshelf.testing.index_store``): LMDB (the store's
own index) and memory."""

from __future__ import annotations

from kvshelf.store.index.lmdb_env import Index
from kvshelf.store.index.memory import MemoryIndexStore
from kvshelf.testing.index_store import IndexStoreTests


class TestMemoryIndexStore(IndexStoreTests):
    def make_store(self, tmp_path):
        return MemoryIndexStore()


class TestLmdbIndexStore(IndexStoreTests):
    def make_store(self, tmp_path):
        return Index(str(tmp_path / "index"))
