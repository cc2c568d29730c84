"""What the offline tools use: listings, chunk re-encoding, in-place snapshot rewrites, repacking, the exclusive
hold and index replacement.

Belongs here: ``surface.py`` (``StoreAdmin``: the tools' calls, ``store.admin``), ``index_swap.py`` (``IndexSwap``:
the exclusive hold and index replacement) and ``repack.py``; the package also names what ``kvshelf.tools``
uses of the rooms beyond ``store.admin`` (chunk re-encoding pieces, ``RemoteAdmin``), so the tools import no room's
module. Each call states how it stays
invisible to live readers (leases honoured, one write transaction per swap, the old copy unlinked only by reclaim).

May import (the room contract in pyproject.toml, checked in CI): what lies below it — ``store.remote``,
``store.integrity``, ``store.restore``, ``store.save``, ``store.space``, ``store.liveness``, ``store.prefix``,
``store.index``, ``store.objects``, ``store.context``, ``store.identity``, ``store.inputs``, ``store.results``,
``store.base``; ``kvshelf.codecs``; and ``kvshelf.errors``. Never a room above it, nor the façade."""

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
