"""The objects: where the store's immutable bytes live (packs of chunks, v1 chunk files, tombstones).

Belongs here: the byte-store protocol (``protocol.py``, with ``open_object``: a reader over any byte store) and its local-directory and memory implementations
(``local.py``, ``memory.py``), packs (``pack.py``: chunks back to back, the manifest in a checksummed trailer; object names of packs and
tombstones), the
sealing at rest (``sealing.py``: the sealed chunk envelope, keyed names, the ``KeyRing`` of per-tenant data
keys), the chunk file format with the one byte shuffle of the compressed form (``chunkfile.py``) and the GIL-free content hash
(``runhash.py``).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.context``,
``store.identity``, ``store.inputs``, ``store.results``, ``store.base``; ``kvshelf.codecs`` (dtype tables); and
``kvshelf.errors``. Never a room above it, nor the façade."""

from .local import LocalByteStore
from .memory import MemoryByteStore
from .protocol import ByteStore, ObjectMissing, capability, open_object
from .sealing import read_key_file

__all__ = ["ByteStore", "LocalByteStore", "MemoryByteStore", "ObjectMissing", "capability", "open_object",
           "read_key_file"]
