"""Sweeping crash residue: ``gc`` removes only what the ledger says is dead (``ledger.object_live``) and no live
lease holds, under the exclusive save gate (no save is between writing its pack and committing it) and the index's
writer lock, then the tombstones nothing needs (``tombs.py``). ``orphans`` is also what ``verify`` lists as residue.
"""

from __future__ import annotations

import dataclasses

from ...errors import StoreBusy, StoreFull
from ..index import keys, ledger
from ..index.tables import quarantined_objects
from ..objects.pack import is_pack
from ..results import GcReport
from ..space import reserve
from .tombs import removable_tombs


def orphans(store, leased: set[str]) -> list[tuple[str, str]]:
    """(object, kind) of every object the ledger does not need and no live lease holds."""
    found = []
    with store.index.read() as txn:
        leased = leased | quarantined_objects(store.index, txn)  # evidence: kept until an operator drops the record
        for prefix in ("packs/", "blobs/"):
            for name in sorted(store.bytes.names(prefix)):
                if name in leased or ledger.object_live(store.index, txn, name):
                    continue
                if is_pack(name):
                    found.append((name, "orphan-blob"))
                elif keys.parse_legacy_blob(name) is not None:
                    found.append((keys.parse_legacy_blob(name)[0], "orphan-blob"))
                elif name.startswith(keys.LEGACY_MANIFESTS) and name.endswith(".msgpack"):
                    found.append((name[len(keys.LEGACY_MANIFESTS):-len(".msgpack")], "orphan-manifest"))
    return found


def object_of(store, name: str, kind: str) -> str | None:
    if is_pack(name):
        return name
    if kind == "orphan-manifest":
        return keys.legacy_manifest(name)
    return next((keys.legacy_blob(name, e) for e in ("raw", "zstd") if store.bytes.exists(keys.legacy_blob(name, e))),
                None)


def orphan_objects(store) -> list[tuple[str, str, int]]:
    out = []
    for name, kind in orphans(store, store._leased_objects()):
        obj = object_of(store, name, kind)
        out.append((name, kind, (store.bytes.size(obj) or 0) if obj is not None else 0))
    return out


def gc_store(store, dry_run: bool = True) -> GcReport:
    """Reap dead tmp files and leases, then sweep orphans in two phases: the listing and ``stat`` of every object
    run with no gate held (saves go on meanwhile); only the re-check of the few candidates and their unlinks run
    under the exclusive save gate — where no save sits between writing its pack and committing it — with the
    leases read again there, so a candidate a commit or a reader took up meanwhile is kept."""
    reap = getattr(store.bytes, "reap_tmp", None)
    tmp = reap(dry_run=dry_run) if reap is not None else []
    expired = store.leases.reap(dry_run=dry_run)
    candidates = []
    for name, kind in orphans(store, store._leased_objects()):  # no gate: O(objects) work while saves run
        obj = object_of(store, name, kind)
        if obj is not None:
            candidates.append((name, kind, obj, (store.bytes.size(obj) or 0) if kind != "orphan-manifest" else 0))
    if not candidates:
        return _with_tombs(store, GcReport(dry_run, [], [], tmp, expired, 0))
    try:
        gate = store.save_gate(exclusive=True, timeout=10.0)
        gate.__enter__()
    except StoreBusy:
        return GcReport(dry_run, [], [], tmp, expired, 0, "saves kept the store busy; orphan sweep skipped")
    try:
        leased = store._leased_objects()

        def sweep(txn):
            blobs, manifests, nbytes = [], [], 0
            kept = leased | quarantined_objects(store.index, txn)
            for name, kind, obj, size in candidates:
                if obj in kept or ledger.object_live(store.index, txn, obj):
                    continue  # committed, leased or quarantined since the listing
                (manifests if kind == "orphan-manifest" else blobs).append(name)
                nbytes += size
                if not dry_run:
                    store.bytes.delete(obj)
                    ledger.forget_pack(store.index, txn, obj)
            return blobs, manifests, nbytes

        if dry_run:
            with store.index.read() as txn:
                blobs, manifests, nbytes = sweep(txn)
        else:
            try:
                blobs, manifests, nbytes = store._txn(sweep)
            except StoreFull:
                if not reserve.release(store.root):
                    raise
                blobs, manifests, nbytes = store._txn(sweep)
    finally:
        gate.__exit__(None, None, None)
    if not dry_run:
        reserve.ensure(store.root)  # space was freed: hold some back again
    return _with_tombs(store, GcReport(dry_run, blobs, manifests, tmp, expired, nbytes))


def _with_tombs(store, report: GcReport) -> GcReport:
    """The tombstones no surviving manifest needs, removed after the objects they guarded (``tombs.py``)."""
    report = dataclasses.replace(report, tombstones=removable_tombs(store))
    if not report.dry_run:
        for name in report.tombstones:
            store.bytes.delete(name)
    return report


__all__ = ["gc_store", "object_of", "orphan_objects", "orphans"]
