"""Removals on a full disk (mixed into ``Store``): delete, quarantine and gc must work exactly when the disk is full.

Why a room of its own: making space is what an operator does on a full disk, so the paths that free space cannot
themselves need space they do not have. Reads need none at all (``objlocks.py``); a removal's index commit needs a
few pages (LMDB is copy-on-write), and gets them in this order of resort:

1. the commit as it is (pages LMDB can reuse from its free list need no new block);
2. the reserve (``reserve.py``, sized for deleting the longest snapshot) is given back and the commit tried again;
3. still full, or no reserve to give: space that nothing can miss is freed first — ``gc``'s own sweep, under the
   exclusive save gate: tmp files of writers that died, lease files of handles that died, objects no index record
   references and no lease or reader lock holds — with the reserve's re-take held off so the freed blocks are there
   for the retry; then the commit once more;
4. still full: ``StoreFull``; the transaction rolled back, nothing changed.

After a removal that freed space the reserve is taken back (``_keep_reserve``); a save grows it as the longest
snapshot this handle has seen grows, and each handle's open sizes it from the index.
"""

from __future__ import annotations

from ...errors import KvShelfError, StoreBusy, StoreFull
from ..index import schema as mf
from . import reserve


class FullDiskMixin:
    """Needs ``index``, ``root``, ``_txn`` and ``gc`` (``Store``)."""

    def _init_fulldisk(self) -> None:
        self._longest = 0
        try:
            for _key, raw in self.index.scan("summaries"):
                try:
                    self._longest = max(self._longest, mf.decode(raw, mf.Summary, "summary").length)
                except KvShelfError:
                    continue
        except KvShelfError:
            pass  # an unreadable index: the reserve keeps its floor; verify tells the operator
        self._keep_reserve()

    def _keep_reserve(self, tokens: int = 0) -> bool:
        """Grow the reserve to what deleting the longest snapshot can need (best effort: False when no room)."""
        self._longest = max(self._longest, tokens)
        try:
            need = reserve.needed_bytes(self.index, self._longest)
        except Exception:  # noqa: BLE001 - an index that cannot say (damaged, closing): keep the last size
            need = None
        return reserve.ensure(self.root, need)

    def _freeing_txn(self, fn):
        """A write transaction that frees space (delete, quarantine), made to work on a full disk (module
        docstring): reserve first, then what is certainly dead, then ``StoreFull`` with nothing changed."""
        try:
            return self._txn(fn)
        except StoreFull as exc:
            full = exc
        if reserve.release(self.root):
            try:
                return self._txn(fn)
            except StoreFull as exc:
                full = exc
        if not self._free_dead():
            raise full
        return self._txn(fn)

    def _free_dead(self) -> bool:
        """``gc``'s sweep with the reserve's re-take held off; True when it may have freed anything."""
        with reserve.suspended(self.root):
            try:
                report = self.gc(dry_run=False)
            except StoreFull:
                return True  # its sweep unlinked before its own commit failed: the space may be there now
            except StoreBusy:
                return False
        return bool(report.orphan_blobs or report.orphan_manifests or report.tmp_files or report.expired_leases)


__all__ = ["FullDiskMixin"]
