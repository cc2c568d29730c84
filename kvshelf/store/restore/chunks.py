"""One indexed chunk by hash, unleased: its record, and a reader over it wherever it lies now.

Why apart from the restore calls: the offline tools (re-encoding, repacking), verify's deep check and the shared
tier's publisher read single chunks by hash without a snapshot's lease (or under one they took themselves). A
re-encoding may move the chunk between reading its location and opening the object, so a missing object is only
called corrupt once the index, read again, still places the chunk there; otherwise the new location is opened.
"""

from __future__ import annotations

from ...errors import CorruptData
from ..base import seams
from ..index import keys, tables
from ..index.protocol import IndexStore
from ..index.schema import ChunkMeta
from ..objects.chunkfile import ChunkReader
from ..objects.protocol import open_object
from ..objects.protocol import ByteStore, ObjectMissing


def chunk_info(index: IndexStore, hash_: str) -> ChunkMeta | None:
    """Refcount, payload bytes, stored bytes, encoding, last use and location of an indexed chunk."""
    with index.read() as txn:
        return tables.chunk_meta(txn, hash_)


def open_chunk(index: IndexStore, byte_store: ByteStore, hash_: str, verify: bool = True, keyring=None) -> ChunkReader:
    """A reader over one indexed chunk in whatever encoding it is stored (raw or zstd), wherever it lies."""
    where = None
    for _attempt in range(4):
        info = chunk_info(index, hash_)
        if info is None:
            raise CorruptData(f"chunk {hash_} is not indexed")
        now = keys.location(hash_, info)
        if now == where:
            break  # it did not move: the object really is gone
        where = now
        seams.BEFORE_OPEN(where[0])
        try:
            source = open_object(byte_store, where[0])
        except ObjectMissing:
            continue
        return ChunkReader(None, hash_ if verify else None, source=source, base=where[1], length=where[2],
                          where=hash_, owns_source=True, keys=keyring, name=hash_)
    raise CorruptData(f"chunk {hash_}: its object {where[0] if where else '?'} is missing")


__all__ = ["chunk_info", "open_chunk"]
