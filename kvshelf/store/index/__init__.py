"""The index: what the store knows, as records in named tables behind one transaction protocol.

Belongs here: the index-transaction protocol (``protocol.py``) and its two implementations (LMDB: ``lmdb_env.py``,
``lmdb_txn.py``; memory: ``memory.py``), LMDB's own safety net (the page walk ``lmdb_pages.py`` and its memo
``lmdb_walk_memo.py``, the open-time checks ``lmdb_check.py``), every key layout (``keys.py``), the record types
(``schema.py``), typed reads of tables (``tables.py``, with the one orphan-checkpoint test) and the marks on chunk copies that failed their hash
(``bad_chunks.py``). The ledger that keeps refcounts and totals in step with the records is ``liveness/ledger.py``
(it also keeps the prefix records, which the prefix room owns).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.context``,
``store.identity``, ``store.inputs``, ``store.results``, ``store.base``; ``kvshelf.codecs`` (record types embed cache
headers); and ``kvshelf.errors``. Never a room above it, nor the façade."""

from .keys import is_checkpoint, parent_of
from .memory import MemoryIndexStore
from .protocol import IndexStore, IndexTxn
from .schema import ChunkMeta, ChunkRef, Manifest, Summary

__all__ = ["ChunkMeta", "ChunkRef", "IndexStore", "IndexTxn", "Manifest", "MemoryIndexStore", "Summary",
           "is_checkpoint", "parent_of"]
