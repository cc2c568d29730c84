"""kvshelf.store: the session store — an LMDB index over content-addressed safetensors chunks, one pack per save.

``open_store(path, identity=Identity(model_id, ...))`` gives a :class:`Store` with ``save``/``save_async``/``flush``,
``restore``/``restore_prefix``/``restore_batch``, ``lookup``, ``sessions``/``delete``, ``pin``/``unpin``,
``stats``/``verify``/``gc``/``rebuild_index``, the generation checkpoints and ``close``; ``store.admin`` holds the
offline tools' calls, and ``open_store(path, admin=True)`` opens a store identity-blind for them.

The façade (``store.py``) only delegates: ``opening.py`` opens the directory into one ``StoreContext``
(``context.py``), ``assembly.py`` builds the collaborators from it, and each public call is one line into the room
that does the work. Each sub-package is one room (its ``__init__`` says what belongs there and what it may import);
the allowed imports are a contract checked in CI (``[tool.importlinter]`` in pyproject.toml), and
docs/ARCHITECTURE.md is the map of the rooms.
"""

from .base import syncs
from .generations import GenerationCheckpoint, continuation_key
from .identity import MAX_TENANT_BYTES, Identity, base_namespace, scoped_namespace, tenant_of, tenant_scope, tenant_token
from .index.schema import BlobRef, ChunkMeta, ChunkRef, Manifest
from .liveness.open_lock import StoreBusy
from .objects.local import LocalByteStore
from .objects.memory import MemoryByteStore
from .objects.protocol import ByteStore
from .objects.sealing import read_key_file
from .results import Finding, GcReport, PrefixHit, Restored, RestoredBatch, SessionInfo, SnapshotInfo
from .store import Store, open_store

__all__ = [
    "MAX_TENANT_BYTES",
    "base_namespace",
    "scoped_namespace",
    "tenant_of",
    "tenant_scope",
    "tenant_token",
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
    "read_key_file",
    "syncs",
]
