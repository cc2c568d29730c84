"""The save path: capture live caches, cut them into chunks, write the new ones as one pack, index it in one commit.

Belongs here: the save calls as users make them (``session_saves.py``: ``SessionSaves``: checked, written,
published), prefix checkpoints (``checkpoints.py``: states along a stored session, docs/CHECKPOINTS.md), the saver
(``saver.py``: ``Saver``), cutting tensors into chunk windows (``chunking.py``) at the cuts of the stored snapshot a save extends
(``alignment.py``), reusing the hashes
of windows a cache proves unchanged (``hash_reuse.py``) and the background writer behind ``save_async``
(``background.py``), and the one write-behind queue every writer behind a caller's back composes (``write_behind.py``:
``WriteBehindQueue``; its worker is a ``BackgroundWriter``).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.space``,
``store.liveness``, ``store.prefix``, ``store.index``, ``store.objects``, ``store.context``, ``store.identity``,
``store.inputs``, ``store.results``, ``store.base``; ``kvshelf.codecs``; and ``kvshelf.errors``. Never a room above
it, nor the façade."""

from .background import BackgroundWriter
from .write_behind import BUSY, CLOSED, FULL, QUEUED, WriteBehindQueue

__all__ = ["BUSY", "BackgroundWriter", "CLOSED", "FULL", "QUEUED", "WriteBehindQueue"]
