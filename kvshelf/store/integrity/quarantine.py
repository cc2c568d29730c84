"""Quarantine: hiding a snapshot whose bytes failed verification, keeping its evidence, and the operator's drop.

Why apart: quarantine keeps what it hides (the objects named in its record, ``index/tables.py``) and, as a removal
that frees space, must work on a full disk (``space/full_disk.py``); none of that is the façade's business.
"""

from __future__ import annotations

import msgspec

from ...errors import KvShelfError
from .. import inputs
from ..context import StoreContext
from ..index import bad_chunks, keys
from ..index import schema
from ..index.schema import Manifest
from ..liveness.removal import Removal
from ..liveness.transactions import Transactions
from ..space.full_disk import FullDisk
from .legacy_v1 import rename_legacy_manifest


class Quarantine:
    def __init__(self, ctx: StoreContext, txns: Transactions, full_disk: FullDisk, removal: Removal):
        self.ctx, self.txns, self.full_disk, self.removal = ctx, txns, full_disk, removal

    def quarantine(self, snapshot_id: str, reason: str, bad: tuple = ()) -> None:
        """Hide a snapshot for good: removed from the index, the session recorded in ``quarantine`` (so restoring
        it says why), a ``tomb/<id>.quarantined`` file keeps the reason (a v1 manifest file is renamed).

        Nothing is unlinked: the objects the snapshot used (its pack, the packs or v1 chunk files of its chunks) are named
        in the quarantine record and kept as evidence — ``verify`` reports the snapshot and ``gc`` skips them —
        until an operator drops the record (``drop_quarantined``, or ``delete`` of the session).

        ``bad``: ``(chunk hash, (object, offset, length))`` of the copies that failed their hash; each is marked bad
        (``index/bad_chunks.py``) in the same write transaction, so no save dedupes onto it again."""

        if self.ctx.read_only:
            return  # a read-only handle cannot hide it: the caller's CorruptData still reports it (access.py)
        sid = bytes.fromhex(snapshot_id)

        def drop(txn):
            for hash_, where in bad:  # marked even when a concurrent call already hid the snapshot
                bad_chunks.mark(txn, hash_, where, reason)
            raw = txn.get("summaries", sid)
            if raw is None:
                return None
            s = schema.decode(raw, schema.Summary, "summary")
            mraw = txn.get("manifests", sid)
            objects = {s.pack} if s.pack else set()
            try:
                m = schema.decode(mraw, Manifest, "manifest") if mraw is not None else None
            except KvShelfError:
                m = None
            for ref in (m.all_chunks if m is not None else ()):
                meta_raw = txn.get("chunks", bytes.fromhex(ref.hash))
                try:
                    meta = schema.decode(meta_raw, schema.ChunkMeta, "chunk record") if meta_raw is not None else None
                except KvShelfError:
                    meta = None
                if meta is not None:
                    objects.add(keys.location(ref.hash, meta)[0])
            removed = self.removal.drop(txn, sid, reason[:2000])
            skey = keys.summary_session_key(s)
            if txn.get("sessions", skey) is None:
                txn.put("quarantine", skey, msgspec.msgpack.encode([snapshot_id, reason[:2000], sorted(o for o in objects if o)]))
            return s, removed

        result = self.full_disk.freeing_txn(drop)
        if result is None:
            return
        s, removed = result
        self.ctx.counters.quarantined += 1
        if not s.pack:  # v1: keep the manifest file as evidence, renamed
            rename_legacy_manifest(self.ctx.bytes, snapshot_id)
        dropped, _freed, tomb = removed  # freed objects stay: evidence, reclaimed by gc after drop_quarantined
        self.removal.after(dropped, [], tomb, quarantined=True)

    def drop_quarantined(self, snapshot_id: str) -> bool:
        """An operator's decision: forget a quarantined snapshot (its record goes; ``gc`` may then reclaim the
        objects it kept). Identity-blind (works on an admin handle). True when a record was dropped."""
        self.ctx.check_writable("drop_quarantined")
        self.ctx.check_open()
        snapshot_id = inputs.check_snapshot_id(snapshot_id)

        def drop(txn):
            hits = []
            for key, raw in txn.range("quarantine"):
                try:
                    rec = msgspec.msgpack.decode(raw)
                    match = str(rec[0]) == snapshot_id
                except (msgspec.DecodeError, ValueError, TypeError, IndexError):
                    match = False
                if match:
                    hits.append(bytes(key))
            for key in hits:
                txn.delete("quarantine", key)
            return bool(hits)

        return self.txns.write(drop)


__all__ = ["Quarantine"]
