"""The one place objects are unlinked, and what holds them back.

Unlinking is safe only under three rules at once: the object is no longer live in the ledger (re-checked in the
unlinking transaction, or after the deaths it acts on committed, so no saver can commit a reference to it
meanwhile), no live lease names it (``lease_files.py``: kernel-released locks, no PID) and no reader on a full disk
holds a lock on it (``object_locks.py``), and it is the byte store's to remove. A quarantined snapshot's objects
are kept as evidence. The lease files are read *after* the deaths acted on committed, so a reader that published
or locked later re-checks after those deaths too and gives up instead of reading.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..context import StoreContext
from ..index import keys
from . import ledger
from ..index.tables import quarantined_objects
from ..objects.protocol import capability
from ..objects.pack import is_pack
from .lease_files import Unknown
from .object_locks import LeasedObjects, prober


class Reclaimer:
    """Unlinks dead, unleased objects of one handle; remembers emptied packs whose records the handle's next write
    transaction forgets (``Transactions`` asks ``take_forgotten``)."""

    def __init__(self, ctx: StoreContext):
        self.ctx = ctx
        self._forget: set[str] = set()  # packs unlinked whose emptied records the next write transaction drops

    def leased_objects(self) -> LeasedObjects:
        """Objects no unlinker may remove: those live leases name, and (asked per name) those a reader on a full disk
        holds a lock on (``object_locks.py``). Call it after the deaths the caller acts on have committed."""
        out: set[str] = set()
        for lease in self.ctx.leases.live():
            out.update(lease.objects)
        path_of = self.ctx.bytes.path if capability(self.ctx.bytes, "local_paths") else None
        return LeasedObjects(out, prober(self.ctx.root, path_of))

    def live_leases(self) -> tuple[set[str], set[str]]:
        """(snapshot ids, chunk hashes) held by live leases of every handle."""
        sids, hashes = set(), set()
        for lease in self.ctx.leases.live():
            sids.add(lease.snapshot_id)
            hashes.update(lease.hashes)
        return sids, hashes

    def reclaim(self, names: Sequence[str]) -> None:
        """Unlink the objects among ``names`` that are dead in the ledger and unleased — no write transaction (no
        fsync): a dead object never becomes live again (only the writer of a fresh pack, or an offline rebuild,
        indexes chunks into an object), and the lease files are read after the drop committed, so a reader either
        is seen here or sees the chunks gone. Emptied pack records are forgotten by the next write transaction."""
        names = [n for n in dict.fromkeys(names) if n]
        if not names:
            return
        index = self.ctx.index
        with index.read() as txn:  # leases read after this snapshot began: see the module docstring
            try:
                leased = self.leased_objects()
            except Unknown:
                return  # a live handle's lease file is unreadable right now: unlink nothing this time (gc will)
            leased = leased | quarantined_objects(index, txn)  # a quarantined snapshot's evidence stays
            dead = [n for n in names if n not in leased and not ledger.object_live(index, txn, n)]
        for name in dead:
            self.ctx.bytes.delete(name)
        with self.ctx.lock:
            self._forget.update(n for n in dead if is_pack(n))

    def unlink_in(self, txn, names: Sequence[str]) -> None:
        """Inside a write transaction (under the writer lock): unlink the dead, unleased objects among ``names`` and
        forget their pack records."""
        index = self.ctx.index
        try:
            leased = self.leased_objects() | quarantined_objects(index, txn)
        except Unknown:
            return
        for name in names:
            if name not in leased and not ledger.object_live(index, txn, name):
                self.ctx.bytes.delete(name)
                ledger.forget_pack(index, txn, name)

    def take_forgotten(self) -> set[str]:
        with self.ctx.lock:
            forget, self._forget = self._forget, set()
        return forget

    def keep_forgotten(self, names: set[str]) -> None:
        """A write transaction that was to forget ``names`` failed: the next one does."""
        with self.ctx.lock:
            self._forget.update(names)

    def forget_in(self, txn, names: set[str]) -> None:
        for name in names:  # packs unlinked by reclaim: drop their (emptied) records
            if not ledger.object_live(self.ctx.index, txn, name):
                ledger.forget_pack(self.ctx.index, txn, name)


__all__ = ["Reclaimer"]
