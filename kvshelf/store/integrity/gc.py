"""Sweeping crash residue: ``gc`` removes only what the ledger says is dead (``ledger.object_live``) and no live
lease holds, under the exclusive save gate (no save is between writing its pack and committing it) and the index's
writer lock, then the tombstones nothing needs (``tombs.py``). ``orphans`` is also what ``verify`` lists as residue.
"""

from __future__ import annotations

import dataclasses

from ...errors import StoreBusy, StoreFull
from ..context import StoreContext
from ..index import keys
from ..liveness import ledger
from ..index.protocol import IndexStore
from ..index.tables import quarantined_objects
from ..liveness.reclaim import Reclaimer
from ..liveness.save_gate import SaveGate
from ..liveness.transactions import Transactions
from ..objects.pack import is_pack
from ..objects.protocol import ByteStore, capability
from ..results import GcReport
from ..space import reserve
from .tombs import removable_tombs


def orphans(index: IndexStore, byte_store: ByteStore, leased: set[str]) -> list[tuple[str, str]]:
    """(object, kind) of every object the ledger does not need and no live lease holds."""
    found = []
    with index.read() as txn:
        leased = leased | quarantined_objects(index, txn)  # evidence: kept until an operator drops the record
        for prefix in ("packs/", "blobs/"):
            for name in sorted(byte_store.names(prefix)):
                if name in leased or ledger.object_live(index, txn, name):
                    continue
                if is_pack(name):
                    found.append((name, "orphan-object"))
                elif keys.parse_legacy_chunk_file(name) is not None:
                    found.append((keys.parse_legacy_chunk_file(name)[0], "orphan-object"))
                elif name.startswith(keys.LEGACY_MANIFESTS) and name.endswith(".msgpack"):
                    found.append((name[len(keys.LEGACY_MANIFESTS):-len(".msgpack")], "orphan-manifest"))
    return found


def object_of(byte_store: ByteStore, name: str, kind: str) -> str | None:
    if is_pack(name):
        return name
    if kind == "orphan-manifest":
        return keys.legacy_manifest(name)
    return next((keys.legacy_chunk_file(name, e) for e in ("raw", "zstd")
                 if byte_store.exists(keys.legacy_chunk_file(name, e))), None)


class Gc:
    """``gc`` and the orphan listing of one handle."""

    def __init__(self, ctx: StoreContext, gate: SaveGate, txns: Transactions, reclaimer: Reclaimer):
        self.ctx, self.gate, self.txns, self.reclaimer = ctx, gate, txns, reclaimer

    def orphans(self) -> list[tuple[str, str, int]]:
        """(name, kind, bytes) of crash residue (``Store.orphans``)."""
        ctx, out = self.ctx, []
        for name, kind in orphans(ctx.index, ctx.bytes, self.reclaimer.leased_objects()):
            obj = object_of(ctx.bytes, name, kind)
            out.append((name, kind, (ctx.bytes.size(obj) or 0) if obj is not None else 0))
        return out

    def gc(self, dry_run: bool = True) -> GcReport:
        """Reap dead tmp files and leases, then sweep orphans in two phases: the listing and ``stat`` of every
        object run with no gate held (saves go on meanwhile); only the re-check of the few candidates and their
        unlinks run under the exclusive save gate — where no save sits between writing its pack and committing
        it — with the leases read again there, so a candidate a commit or a reader took up meanwhile is kept."""
        ctx = self.ctx
        index, objects = ctx.index, ctx.bytes
        tmp = objects.reap_tmp(dry_run=dry_run) if capability(objects, "reaps_tmp") else []
        expired = ctx.leases.reap(dry_run=dry_run)
        candidates = []
        for name, kind in orphans(index, objects, self.reclaimer.leased_objects()):  # no gate: O(objects) work
            obj = object_of(objects, name, kind)
            if obj is not None:
                candidates.append((name, kind, obj, (objects.size(obj) or 0) if kind != "orphan-manifest" else 0))
        if not candidates:
            return self._with_tombs(GcReport(dry_run, [], [], tmp, expired, 0))
        try:
            gate = self.gate.hold(exclusive=True, timeout=10.0)
            gate.__enter__()
        except StoreBusy:
            return GcReport(dry_run, [], [], tmp, expired, 0, "saves kept the store busy; orphan sweep skipped")
        try:
            leased = self.reclaimer.leased_objects()

            def sweep(txn):
                orphaned, manifests, nbytes = [], [], 0
                kept = leased | quarantined_objects(index, txn)
                for name, kind, obj, size in candidates:
                    if obj in kept or ledger.object_live(index, txn, obj):
                        continue  # committed, leased or quarantined since the listing
                    (manifests if kind == "orphan-manifest" else orphaned).append(name)
                    nbytes += size
                    if not dry_run:
                        objects.delete(obj)
                        ledger.forget_pack(index, txn, obj)
                return orphaned, manifests, nbytes

            if dry_run:
                with index.read() as txn:
                    orphaned, manifests, nbytes = sweep(txn)
            else:
                try:
                    orphaned, manifests, nbytes = self.txns.write(sweep)
                except StoreFull:
                    if not reserve.release(ctx.root):
                        raise
                    orphaned, manifests, nbytes = self.txns.write(sweep)
        finally:
            gate.__exit__(None, None, None)
        if not dry_run:
            reserve.ensure(ctx.root)  # space was freed: hold some back again
        return self._with_tombs(GcReport(dry_run, orphaned, manifests, tmp, expired, nbytes))

    def _with_tombs(self, report: GcReport) -> GcReport:
        """The tombstones no surviving manifest needs, removed after the objects they guarded (``tombs.py``)."""
        report = dataclasses.replace(report, tombstones=removable_tombs(self.ctx.index, self.ctx.bytes))
        if not report.dry_run:
            for name in report.tombstones:
                self.ctx.bytes.delete(name)
        return report


__all__ = ["Gc", "object_of", "orphans"]
