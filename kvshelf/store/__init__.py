"""kvshelf.store: the session store — an LMDB index over content-addressed safetensors chunks, one pack per save.

``open_store(path, identity=Identity(model_id, ...))`` gives a :class:`Store` with ``save``/``save_async``/``flush``,
``restore``/``restore_prefix``/``restore_batch``, ``lookup``, ``sessions``/``delete``, ``stats``/``verify``/``gc``/
``rebuild_index`` and ``close``; ``open_store(path, admin=True)`` opens it identity-blind for offline tools. The layout and the guarantees are described in docs/ARCHITECTURE.md §3.
"""

from .objects.protocol import ByteStore
from .objects.memory import MemoryByteStore
from .identity import Identity
from .objects.local import LocalByteStore
from .index.schema import BlobRef, ChunkMeta, Manifest
from .results import Finding, GcReport, PrefixHit, Restored, RestoredBatch, SessionInfo, SnapshotInfo
from .liveness.open_lock import StoreBusy
from .store import Store, open_store
from .generations import GenerationCheckpoint, continuation_key

__all__ = [
    "BlobRef",
    "ByteStore",
    "ChunkMeta",
    "Finding",
    "GcReport",
    "GenerationCheckpoint",
    "Identity",
    "LocalByteStore",
    "Manifest",
    "MemoryByteStore",
    "PrefixHit",
    "Restored",
    "RestoredBatch",
    "SessionInfo",
    "SnapshotInfo",
    "Store",
    "StoreBusy",
    "continuation_key",
    "open_store",
]
