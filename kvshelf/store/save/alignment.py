"""Which stored chunk windows a save keeps its cuts at (``chunking.cuts`` takes them): those of the stored snapshot
its tokens extend.

Why: a grown session that cuts where its last save cut writes only its new rows (the old tail stays a chunk), and
anything else that extends a stored snapshot — a fork restored from it under another session id, a prefix
checkpoint of it — names the shared rows' chunks exactly as that snapshot did, so they dedupe. Only cuts come from
here, never hashes: whether a window is stored is still decided by its content hash, so a wrong or stale answer
costs bytes written, never a wrong chunk.

Where from, cheapest first: the session's last save through this handle (its ``Remembered`` windows, process
memory); else the local index's longest-prefix search (``prefix.search``: the snapshot sharing the most tokens with
this save) and that snapshot's manifest, read in one read transaction. Windows past the shared prefix are dropped.
"""

from __future__ import annotations

from ...errors import KvShelfError
from ..context import StoreContext
from ..identity import namespace_key
from ..index import schema
from ..prefix.index_records import IndexRecords
from ..prefix.search import LazyTokens, PrefixSearch


def remembered_windows(prev) -> list[tuple[int, int]]:
    """The token windows of a ``hash_reuse.Remembered`` save, sorted."""
    return sorted((start, stop) for start, (stop, _desc, _hash) in prev.windows.items())


def searched_windows(ctx: StoreContext, namespace: str, tokens) -> list[tuple[int, int]]:
    """The windows of the stored snapshot sharing the longest prefix with ``tokens`` (none: ``[]``), up to it."""
    if len(tokens) < 2:
        return []
    try:
        return _searched(ctx, namespace, tokens)
    except KvShelfError:  # a damaged record: the save cuts on the grid; the index's own checks report the damage
        return []


def _searched(ctx: StoreContext, namespace: str, tokens) -> list[tuple[int, int]]:
    with ctx.index.read() as txn:
        found = PrefixSearch(IndexRecords(txn), namespace_key(ctx.id_key, namespace), LazyTokens(tokens),
                             ctx.block).run()
        if found is None:
            return []
        raw = txn.get("manifests", found.sid)
        if raw is None:
            return []
        manifest = schema.decode(raw, schema.Manifest, f"manifest {found.sid.hex()}")
    return [(r.start, r.stop) for r in manifest.chunks if r.stop <= found.length]


def stored_windows(ctx: StoreContext, book, key: tuple[str, str], tokens) -> list[tuple[int, int]]:
    """The windows a save of session ``key`` = (namespace, session id) with ``tokens`` keeps (see the module
    docstring)."""
    prev = book.get(key)
    if prev is not None and prev.chunk_tokens == ctx.chunk_tokens:
        return remembered_windows(prev)
    return searched_windows(ctx, key[0], tokens)


__all__ = ["remembered_windows", "searched_windows", "stored_windows"]
