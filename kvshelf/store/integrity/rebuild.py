"""``rebuild_index``: a new index built from what is on disk — the packs' trailers and sealed v1 manifest files.

Why a room of its own: it is the one path that trusts the byte store over the index, so what it may believe is
spelled out here: a manifest is indexed only when its checksum holds (a pack trailer, or a v1 file sealed by
``legacy_v1.py``), its chunks are all present in some readable pack or v1 chunk file, and no tombstone says its session was
removed at or after it (``tombs.py``); every object or manifest left out becomes a ``Finding`` in ``skipped``.
"""

from __future__ import annotations


import msgspec

from ...errors import CorruptData, IncompatibleFormat, KvShelfError
from ..context import StoreContext
from ..index import tables
from ..index import keys
from ..liveness import ledger
from ..index import schema
from ..objects.protocol import ObjectMissing
from ..objects.protocol import open_object
from ..index.schema import Manifest
from ..objects.pack import TOMB_DIR, is_pack, read_trailer
from ..results import Finding
from ..index.keys import parent_of


class Rebuild:
    """``rebuild_index`` of one handle; ``swap`` (``admin.index_swap.IndexSwap``) holds the store alone and empties
    its index. ``report`` is what the last rebuild left out and why."""

    def __init__(self, ctx: StoreContext, swap):
        self.ctx, self.swap = ctx, swap
        self.report: list[Finding] = []

    def rebuild(self) -> int:
        """Replace the index by one built from the packs' trailers and v1 manifest files (offline: the store held
        ``exclusive``, so no other process or handle has it open; ``StoreBusy`` otherwise). Nothing that fails its
        checksum or does not decode is indexed, nor a v1 manifest file that is not sealed (no checksum to check);
        each such object, and each manifest left out (a chunk missing, its session tombstoned), is put in
        ``report`` as a ``Finding`` saying why."""
        self.report = skipped = []
        with self.swap.exclusive():
            self.swap.empty_index()
            return _reindex(self.ctx.index, self.ctx.bytes, skipped)


def _tombs(byte_store) -> tuple[set[str], dict[bytes, float]]:
    """(tombstoned snapshot ids, per session key the creation time up to which its snapshots were removed)."""
    sids, dead_until = set(), {}
    for name in byte_store.names(TOMB_DIR):
        sids.add(name[len(TOMB_DIR):].split(".")[0])
        try:
            buf = bytearray(byte_store.size(name) or 0)
            byte_store.read_into(name, 0, [memoryview(buf)])
            skey, created_at, _reason = msgspec.msgpack.decode(bytes(buf))
            dead_until[skey] = max(dead_until.get(skey, float("-inf")), float(created_at))
        except (ValueError, TypeError, msgspec.DecodeError, CorruptData, ObjectMissing):
            continue  # a tombstone lost its content in a crash: its own snapshot stays excluded
    return sids, dead_until


def _reindex(index, byte_store, skipped: list[Finding]) -> int:
    tombs, dead_until = _tombs(byte_store)
    located: ledger.Placed = {}
    sizes: dict[str, int] = {}
    found: dict[str, tuple[int, Manifest, str]] = {}
    for name in sorted(byte_store.names("packs/")):
        if not is_pack(name):
            continue
        try:
            with open_object(byte_store, name) as r:
                contents = read_trailer(r, name)
                sizes[name] = r.size()
        except (CorruptData, ObjectMissing) as exc:
            skipped.append(Finding("rebuild-skipped-pack", f"pack {name}", f"not indexed: {exc}"))
            continue
        for h, off, n, enc in contents.chunks:
            located.setdefault(h, (name, off, n, enc, sizes[name]))
        if contents.manifest:
            _consider(found, contents.manifest, contents.written_ns, name, tombs, skipped)
    for name in sorted(byte_store.names("blobs/")):
        legacy = keys.parse_legacy_chunk_file(name)
        if legacy is not None:
            located.setdefault(legacy[0], (name, 0, byte_store.size(name) or 0, legacy[1], 0))
        elif name.startswith(keys.LEGACY_MANIFESTS) and name.endswith(".msgpack"):
            buf = bytearray(byte_store.size(name) or 0)
            try:
                byte_store.read_into(name, 0, [memoryview(buf)])
            except (KvShelfError, OSError) as exc:
                skipped.append(Finding("rebuild-skipped-manifest", name, f"unreadable: {exc}"))
                continue
            if not schema.is_sealed(buf):  # no checksum: a flipped token would be indexed as a true one
                skipped.append(_unsealed(name, bytes(buf)))
                continue
            _consider(found, bytes(buf), 0, "", tombs, skipped, what=name)
    ordered = sorted(found.values(), key=lambda item: item[1].created_at)
    for _written, m, pack in ordered:  # oldest first: a session's newest snapshot replaces older ones
        where = f"snapshot {m.snapshot_id} (session {m.session_id!r})"
        missing = [r.hash for r in m.all_chunks if r.hash not in located]
        if missing:
            skipped.append(Finding("rebuild-skipped-snapshot", where, f"{len(missing)} of its chunks are in no "
                                   f"readable pack or v1 chunk file (first: {missing[0]})", (m.session_id,)))
            continue
        if m.created_at <= dead_until.get(keys.manifest_keys(m)[2], float("-inf")):
            continue  # its session was deleted, evicted or quarantined at or after this snapshot (not a loss)
        if _checkpoint_of_dead(m, dead_until):
            continue
        placed = {r.hash: located[r.hash] for r in m.all_chunks}
        index.write(lambda txn, m=m, pack=pack, placed=placed: ledger.commit(
            index, txn, m, pack, sizes.get(pack, 0), placed))
    _drop_orphan_checkpoints(index)
    with index.read() as txn:
        return txn.count("manifests")


def _checkpoint_of_dead(m: Manifest, dead_until: dict[bytes, float]) -> bool:
    """A checkpoint made before its session was removed is gone with it (save/checkpoints.py)."""
    parent = parent_of(m.session_id)
    if parent is None:
        return False
    idk, nsk, _ = keys.manifest_keys(m)
    return m.created_at <= dead_until.get(keys.session_key(idk, nsk, parent[0]), float("-inf"))


def _drop_orphan_checkpoints(index) -> None:
    """Checkpoints whose session was not brought back (never saved, or removed) are not indexed either."""
    def drop(txn):
        for sid in tables.orphan_checkpoints(txn):
            ledger.drop(index, txn, sid)

    index.write(drop)


def _unsealed(name: str, raw: bytes) -> Finding:
    """Why a v1 manifest file was left out: it carries no checksum (the sessions it names are only a hint)."""
    try:
        m = schema.decode(raw, Manifest, name)
        who, where = (m.session_id,), f"{name} (snapshot {m.snapshot_id}, session {m.session_id!r})"
    except (CorruptData, IncompatibleFormat):
        who, where = (), name
    return Finding("rebuild-skipped-manifest", where, "not indexed: an unsealed v1 manifest file (no checksum, so "
                   "its tokens cannot be trusted; a v2 store seals those agreeing with its index when it opens)", who)


def _consider(found: dict, raw: bytes, written_ns: int, pack: str, tombs: set[str], skipped: list[Finding],
              what: str = "") -> None:
    what = what or pack
    try:
        m = schema.decode(raw, Manifest, f"manifest in {what}")
    except (CorruptData, IncompatibleFormat) as exc:
        skipped.append(Finding("rebuild-skipped-manifest", what, f"not indexed: {exc}"))
        return
    if m.snapshot_id in tombs:
        return
    have = found.get(m.snapshot_id)
    if have is None or written_ns > have[0]:  # an in-place rewrite (compaction) wrote a newer one
        found[m.snapshot_id] = (written_ns, m, pack)


__all__ = ["Rebuild"]
