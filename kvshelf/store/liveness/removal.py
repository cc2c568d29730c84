"""Dropping a snapshot for good (delete, eviction, quarantine): the ledger's drop in the caller's write
transaction, then — after the commit — a tombstone and the unlink of what died.

The tombstone (the session and its creation time) keeps ``rebuild_index`` from bringing back this snapshot or an
older one of its session from a pack that outlives it; it is not synced (it only matters if the index is lost).
Callers hold ``removers.removing()`` from before their commit to the unlink (verify tells residue from this).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ...errors import KvShelfError
from ..base import seams
from ..context import StoreContext
from ..index import keys, tables
from . import ledger
from ..objects.protocol import put_unsynced
from ..objects.pack import tomb as tomb_name
from .reclaim import Reclaimer

Dropped = tuple[bytes, list[str], bytes]  # (snapshot id, objects freed, tombstone)


class Removal:
    """``followers``: records that follow a session and go with its snapshot, in the same write transaction (each
    has ``forget(txn, summary)``, returning the objects it freed, if any: the session's pin, ``space/pins.py``; its
    checkpoints, ``save/checkpoints.py``)."""

    def __init__(self, ctx: StoreContext, reclaimer: Reclaimer, followers: Sequence = ()):
        self.ctx, self.reclaimer, self.followers = ctx, reclaimer, tuple(followers)

    def drop(self, txn, sid: bytes, reason: str = "") -> Dropped | None:
        """Drop a snapshot in ``txn``: (sid, objects freed, tombstone), or None when it is not indexed."""
        s = tables.summary(txn, sid)
        if s is None:
            return None
        tomb = msgspec.msgpack.encode([keys.summary_session_key(s), s.created_at, reason])
        freed = ledger.drop(self.ctx.index, txn, sid)
        for follower in self.followers:
            freed += follower.forget(txn, s) or []
        return sid, freed, tomb

    def after(self, dropped: bytes, freed: list[str], tomb: bytes, quarantined: bool = False) -> None:
        """After the drop committed: unlink what is dead, then leave the tombstone."""
        seams.BEFORE_UNLINK()
        self.reclaimer.reclaim(freed)
        try:
            put_unsynced(self.ctx.bytes, tomb_name(dropped.hex(), quarantined=quarantined), [tomb])
        except (KvShelfError, OSError):  # e.g. a full disk: the removal itself is committed; only a rebuild of a
            pass                         # lost index could bring the snapshot back


__all__ = ["Dropped", "Removal"]
