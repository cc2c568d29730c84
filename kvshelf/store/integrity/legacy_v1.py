"""Sealing layout v1's manifest files, so that ``rebuild_index`` never has to trust an unchecked one.

A v1 store keeps each snapshot's manifest in ``blobs/manifests/<sid>.msgpack`` as bare msgpack: no checksum, so a
flipped byte inside a token id decodes as another valid token, and a rebuild from that file would index (and later
serve) caches under tokens they were never computed for. v2 records are sealed (``schema.encode``: ``0xC1 |
xxh3-64 | msgpack``); ``seal_v1_manifests`` rewrites each v1 manifest file in that form — only after checking that
it agrees with the index's own record of the snapshot (two independent copies that agree are the best evidence a
v1 store has), atomically through the byte store's durable ``put`` (tmp file, fsync, rename, directory fsync).
``rebuild_index`` then indexes a v1 manifest file only when it is sealed and its checksum holds, and reports every
other one; ``verify`` reports a v1 snapshot whose manifest file is still unsealed (a rebuild would leave it out).

Why when a store is opened and not in ``kvshelf compact``: compaction does seal them too (its repack step moves
every v1 manifest into a manifest-only pack, whose trailer is checksummed), but it is optional and may never run,
while ``rebuild_index`` is exactly what an operator reaches for when the index is lost — every hour between the
first v2 open and a compaction would be an hour in which a rebuild either trusts unchecked files or loses every v1
snapshot. Opening is also the one moment the index is known to be there to check the files against. The work is
done once per index: the meta key ``v1_manifests_sealed`` records that every file was looked at (a file that
disagrees with the index stays unsealed, and is reported by ``verify`` and ``rebuild_index``, not retried); a store
with no v1 manifest file writes nothing, so opening a v2 store costs one listing of an absent directory.

Failures never fail the open (a full disk must still open, so that deleting can free it): the key is then not
written and the next open tries again. Concurrent openers seal the same bytes (atomic renames, identical content).
A file rewritten just as another process moves it into a pack, deletes or quarantines its snapshot comes back as
a dead object: ``gc`` reclaims it, and ``rebuild_index`` prefers the pack's newer manifest or skips the tombstoned
snapshot.
"""

from __future__ import annotations

from ...errors import IncompatibleFormat, KvShelfError
from ..index import keys
from ..index import schema
from ..objects.protocol import ObjectMissing, put_unsynced
from ..index.schema import Manifest, Summary

SEALED_KEY = b"v1_manifests_sealed"  # meta: every v1 manifest file of this index was examined (sealed or left)


def read_object(byte_store, name: str) -> bytes | None:
    """A whole (small) object, or None when it is gone."""
    size = byte_store.size(name)
    if size is None:
        return None
    buf = bytearray(size)
    try:
        byte_store.read_into(name, 0, [memoryview(buf)])
    except ObjectMissing:
        return None
    return bytes(buf)


def v1_manifest_names(byte_store) -> list[str]:
    """Every v1 manifest file (``blobs/manifests/<sid>.msgpack``; not the ``.quarantined`` evidence)."""
    return sorted(n for n in byte_store.names(keys.LEGACY_MANIFESTS) if n.endswith(".msgpack"))


def sid_of(name: str) -> str:
    return name[len(keys.LEGACY_MANIFESTS):-len(".msgpack")]


def seal_v1_manifests(index, byte_store) -> int:
    """Seal every unsealed v1 manifest file that agrees with the index (once per index); returns files sealed.
    Never raises on damaged data or a failing disk: what it could not do is left for the next open."""
    try:
        with index.read() as txn:
            if txn.get("meta", SEALED_KEY) is not None:
                return 0
        names = v1_manifest_names(byte_store)
        if not names:
            return 0
        sealed = sum(_seal_one(index, byte_store, name) for name in names)
        index.write(lambda txn: txn.put("meta", SEALED_KEY, b"\x01"))
        return sealed
    except (KvShelfError, OSError):
        return 0


def _seal_one(index, byte_store, name: str) -> bool:
    raw = read_object(byte_store, name)
    if raw is None or schema.is_sealed(raw):
        return False  # gone meanwhile, or sealed already (a failing checksum is rebuild's and verify's to report)
    sid_hex = sid_of(name)
    try:
        on_disk = schema.decode(raw, Manifest, name)
        sid = bytes.fromhex(sid_hex)
        with index.read() as txn:
            record, summary = txn.get("manifests", sid), txn.get("summaries", sid)
        if record is None or summary is None or schema.decode(summary, Summary, f"summary {sid_hex}").pack:
            return False  # not indexed, or its manifest lives in a pack now: the file is dead (gc's)
        if schema.decode(record, Manifest, f"manifest {sid_hex}") != on_disk or on_disk.snapshot_id != sid_hex:
            return False  # the two copies disagree: neither is trusted into a seal
    except (KvShelfError, IncompatibleFormat, ValueError):
        return False
    byte_store.put(name, [schema.encode(on_disk)])  # durable: tmp, fsync, rename, directory fsync
    return True


def rename_legacy_manifest(byte_store, sid_hex: str) -> None:
    """A quarantined v1 snapshot keeps its manifest file as evidence, renamed ``.quarantined``."""
    src = keys.legacy_manifest(sid_hex)
    size = byte_store.size(src)
    if size is None:
        return
    buf = bytearray(size)
    byte_store.read_into(src, 0, [memoryview(buf)])
    put_unsynced(byte_store, keys.legacy_manifest(sid_hex, quarantined=True), [buf])
    byte_store.delete(src)


__all__ = ["SEALED_KEY", "read_object", "rename_legacy_manifest", "seal_v1_manifests", "sid_of", "v1_manifest_names"]
