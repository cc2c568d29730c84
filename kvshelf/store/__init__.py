"""kvshelf.store: the session store — an LMDB index over content-addressed safetensors chunks, one pack per save.

``open_store(path, identity=Identity(model_id, ...))`` gives a :class:`Store` with ``save``/``save_async``/``flush``,
``restore``/``restore_prefix``/``restore_batch``, ``lookup``, ``sessions``/``delete``, ``pin``/``unpin``,
``stats``/``verify``/``gc``/``rebuild_index``, the generation checkpoints and ``close``; ``store.admin`` holds the
offline tools' calls, and ``open_store(path, admin=True)`` opens a store identity-blind for them.

The façade (``store.py``) checks inputs (``inputs.py``), builds its collaborators from one ``StoreContext``
(``context.py``) and delegates; each sub-package is one room (its ``__init__`` says what belongs there and what it
may import), and docs/ARCHITECTURE.md is the map of the rooms.
"""

from .objects.protocol import ByteStore
from .objects.memory import MemoryByteStore
from .identity import Identity
from .objects.local import LocalByteStore
from .index.schema import BlobRef, ChunkMeta, ChunkRef, Manifest
from .results import Finding, GcReport, PrefixHit, Restored, RestoredBatch, SessionInfo, SnapshotInfo
from .liveness.open_lock import StoreBusy
from .store import Store, open_store
from .generations import GenerationCheckpoint, continuation_key

__all__ = [
    "BlobRef",
    "ChunkRef",
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
