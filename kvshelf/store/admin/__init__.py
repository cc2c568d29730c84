"""What the offline tools use: listings, chunk re-encoding, in-place snapshot rewrites, repacking, the exclusive
hold and index replacement.

Belongs here: ``surface.py`` (``StoreAdmin``: the tools' calls, ``store.admin``), ``index_swap.py`` (``IndexSwap``:
the exclusive hold and index replacement) and ``repack.py``. Each call states how it stays
invisible to live readers (leases honoured, one write transaction per swap, the old copy unlinked only by reclaim).

May import: every other room of the store, never the façade. ``kvshelf.tools`` calls nothing else of the store.
"""

# What kvshelf.tools uses of the store beyond ``Store``/``store.admin``: named here, so the tools import no room's
# module and a room can move its internals without breaking them.
from ..index.lmdb_check import set_aside as set_aside_index
from ..objects.chunkfile import KVZ_MAGIC, Piece, content_hash, kvz_buffers, storage_dtype
from ..remote.maintenance import RemoteAdmin
from ..restore.destinations import Destinations, fill_from_chunk
from ..save.chunking import plan_chunks
from .repack import REWRITE_OVERHEAD
from .surface import StoreAdmin

__all__ = ["KVZ_MAGIC", "REWRITE_OVERHEAD", "Destinations", "Piece", "RemoteAdmin", "StoreAdmin", "content_hash",
           "fill_from_chunk", "kvz_buffers", "plan_chunks", "set_aside_index", "storage_dtype"]
