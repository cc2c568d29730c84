"""Removals on a full disk: delete, quarantine and gc must work exactly when the disk is full.

Why a room of its own: making space is what an operator does on a full disk, so the paths that free space cannot
themselves need space they do not have. Reads need none at all (``liveness/object_locks.py``); a removal's index commit needs a
few pages (LMDB is copy-on-write), and gets them in this order of resort:

1. the commit as it is (pages LMDB can reuse from its free list need no new block);
2. the reserve (``reserve.py``, sized for deleting the longest snapshot) is given back and the commit tried again;
3. still full, or no reserve to give: space that nothing can miss is freed first — ``gc``'s own sweep, under the
   exclusive save gate: tmp files of writers that died, lease files of handles that died, objects no index record
   references and no lease or reader lock holds — with the reserve's re-take held off so the freed blocks are there
   for the retry; then the commit once more;
4. still full: ``StoreFull``; the transaction rolled back, nothing changed.

After a removal that freed space the reserve is taken back (``keep_reserve``); a save grows it as the longest
snapshot this handle has seen grows, and each handle's open sizes it from the index.
"""

from __future__ import annotations

from ...errors import KvShelfError, SnapshotNotFound, StoreBusy, StoreFull
from ..context import StoreContext
from ..index import schema
from ..liveness.removal import Removal
from ..liveness.transactions import Transactions
from . import reserve


class FullDisk:
    """Removals that work on a full disk, and the reserve that lets them. Built once the index is open: it sizes
    and takes the reserve at once, from the longest snapshot the index holds. ``sweeper`` is ``gc``'s owner
    (``integrity.gc.Gc``): its sweep is what step 3 frees."""

    def __init__(self, ctx: StoreContext, txns: Transactions, removal: Removal, sweeper):
        self.ctx, self.txns, self.removal, self.sweeper = ctx, txns, removal, sweeper
        self._longest = 0
        try:
            for _key, raw in ctx.index.scan("summaries"):
                try:
                    self._longest = max(self._longest, schema.decode(raw, schema.Summary, "summary").length)
                except KvShelfError:
                    continue
        except KvShelfError:
            pass  # an unreadable index: the reserve keeps its floor; verify tells the operator
        self.keep_reserve()

    def keep_reserve(self, tokens: int = 0) -> bool:
        """Grow the reserve to what deleting the longest snapshot can need (best effort: False when no room; a
        read-only handle keeps none: it deletes nothing)."""
        self._longest = max(self._longest, tokens)
        if self.ctx.read_only:
            return False
        try:
            need = reserve.needed_bytes(self.ctx.index, self._longest)
        except Exception:  # noqa: BLE001 - an index that cannot say (damaged, closing): keep the last size
            need = None
        return reserve.ensure(self.ctx.root, need)

    def freeing_txn(self, fn):
        """A write transaction that frees space (delete, quarantine), made to work on a full disk (module
        docstring): reserve first, then what is certainly dead, then ``StoreFull`` with nothing changed."""
        try:
            return self.txns.write(fn)
        except StoreFull as exc:
            full = exc
        if reserve.release(self.ctx.root):
            try:
                return self.txns.write(fn)
            except StoreFull as exc:
                full = exc
        if not self._free_dead():
            raise full
        return self.txns.write(fn)

    def delete(self, skey: bytes, session_id: str, namespace: str, also=None) -> None:
        """``Store.delete``: drop the session's snapshot (or its quarantine record: the operator's "drop it");
        chunks no other snapshot references are freed. ``SnapshotNotFound`` when there is neither. ``also(txn)``
        runs in the same write transaction (the records that follow the session)."""

        def drop(txn):
            sid = txn.get("sessions", skey)
            had_quarantine = txn.delete("quarantine", skey)
            if also is not None:
                also(txn)
            if sid is None:
                return "quarantine" if had_quarantine else None
            return self.removal.drop(txn, bytes(sid))

        with self.ctx.removers.removing():  # from the commit to the unlink (verify tells residue from this)
            result = self.freeing_txn(drop)
            if result == "quarantine":
                return
            if result is None:
                raise SnapshotNotFound(f"no session {session_id!r} in namespace {namespace!r} to delete")
            self.removal.after(*result)
        self.keep_reserve()  # space was freed: hold back again what the next delete may need

    def _free_dead(self) -> bool:
        """``gc``'s sweep with the reserve's re-take held off; True when it may have freed anything."""
        with reserve.suspended(self.ctx.root):
            try:
                report = self.sweeper.gc(dry_run=False)
            except StoreFull:
                return True  # its sweep unlinked before its own commit failed: the space may be there now
            except StoreBusy:
                return False
        return bool(report.orphan_objects or report.orphan_manifests or report.tmp_files or report.expired_leases)


__all__ = ["FullDisk"]
