"""The index: what the store knows, as records in named tables behind one transaction protocol.

Belongs here: the index-transaction protocol (``protocol.py``) and its two implementations (LMDB: ``lmdb_env.py``,
``lmdb_txn.py``; memory: ``memory.py``), LMDB's own safety net (the page walk ``lmdb_pages.py`` and its memo
``lmdb_walk_memo.py``, the open-time checks ``lmdb_check.py``), every key layout (``keys.py``), the record types
(``schema.py``), typed reads of tables (``tables.py``) and the marks on chunk copies that failed their hash
(``bad_chunks.py``). The ledger that keeps refcounts and totals in step with the records is ``liveness/ledger.py``
(it also keeps the prefix records, which the prefix room owns).

May import: ``kvshelf.errors``, ``kvshelf.codecs`` (record types embed cache headers) and ``store.syncs``/``tally``.
Never the façade or any other room of the store: every room reads and writes the index through this protocol.
"""

from .keys import is_checkpoint, parent_of
from .memory import MemoryIndexStore
from .protocol import IndexStore, IndexTxn
from .schema import ChunkMeta, ChunkRef, Manifest, Summary

__all__ = ["ChunkMeta", "ChunkRef", "IndexStore", "IndexTxn", "Manifest", "MemoryIndexStore", "Summary",
           "is_checkpoint", "parent_of"]
