"""The objects: where the store's immutable bytes live (packs of chunks, v1 blobs, tombstones).

Belongs here: the byte-store protocol (``protocol.py``) and its local-directory and memory implementations
(``local.py``, ``memory.py``), packs (``pack.py``: chunks back to back, the manifest in a checksummed trailer), the
chunk file format with the one byte shuffle of the compressed form (``chunkfile.py``) and the GIL-free content hash
(``runhash.py``).

May import: ``kvshelf.errors``, ``kvshelf.codecs`` (dtype tables), ``store.seams``/``syncs``/``tally``. Never the
index (objects do not know what references them), the façade or another room.
"""

from .local import LocalByteStore
from .memory import MemoryByteStore
from .protocol import ByteStore, ObjectMissing, capability, open_object

__all__ = ["ByteStore", "LocalByteStore", "MemoryByteStore", "ObjectMissing", "capability", "open_object"]
