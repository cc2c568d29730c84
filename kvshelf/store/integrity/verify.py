"""Checking a store: ``verify`` (the test oracle).

``verify`` recomputes from the manifests what every other table must hold (refcounts, per-pack counts, the prefix
records and heads of every session's current snapshot, sessions, LRU keys, total bytes) and compares, then checks
the byte store against the index; it streams (``integrity/verify_counts.py`` says how its memory stays bounded and why a save or
delete committing meanwhile never becomes a finding). ``gc`` is ``gc.py``, ``rebuild_index`` is ``rebuild.py``.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ...errors import CorruptData, IncompatibleFormat, KvShelfError, StoreBusy
from ..base import seams
from ..index import keys
from ..liveness import ledger
from ..prefix import records
from . import verify_counts
from ..index import schema
from ..objects.protocol import ObjectMissing
from ..index import tables
from ..index.tables import quarantined_objects
from ..objects.protocol import open_object
from ..index.schema import Manifest, Summary
from ..objects.pack import read_trailer
from ..results import Finding
from ..context import StoreContext
from ..liveness.reclaim import Reclaimer
from ..liveness.save_gate import SaveGate
from ..objects.pack import is_pack
from .gc import object_of, orphans
from .legacy_v1 import SEALED_KEY



class DamagedTrailer(Exception):
    """The snapshot's pack is there but its trailer does not read (``verify`` reports the pack, not a missing file)."""


def _manifest_on_disk(byte_store, sid_hex: str, summary: Summary) -> bytes | None:
    try:
        if summary.pack:
            with open_object(byte_store, summary.pack) as r:
                try:
                    return read_trailer(r, summary.pack).manifest
                except CorruptData as exc:
                    raise DamagedTrailer(_plain(str(exc), summary.pack)) from None
        size = byte_store.size(keys.legacy_manifest(sid_hex))
        if size is None:
            return None
        buf = bytearray(size)
        byte_store.read_into(keys.legacy_manifest(sid_hex), 0, [memoryview(buf)])
        return bytes(buf)
    except (ObjectMissing, CorruptData):
        return None


class Verifier:
    """``verify`` of one handle: the index against itself and against the byte store."""

    def __init__(self, ctx: StoreContext, gate: SaveGate, reclaimer: Reclaimer):
        self.ctx, self.gate, self.reclaimer = ctx, gate, reclaimer

    def verify(self, deep: bool = False, mark_bad: bool = True) -> list[Finding]:
        """Every inconsistency as a ``Finding``; never raises on damaged data (a record, pack or index that cannot
        be read at all is a finding too), and every quarantined snapshot stays a finding until an operator drops
        it. ``mark_bad``: a chunk copy found missing or failing its hash is marked bad (``verify_counts._marked``; the
        only write verify makes); a repair dry run passes False, as it must change nothing."""
        out: list[Finding] = []
        try:
            _verify(self, deep, out, mark_bad)
        except (KvShelfError, ObjectMissing, OSError) as exc:
            out.append(Finding("unreadable-index", "index", f"verify stopped: {type(exc).__name__}: {exc}"))
        except Exception as exc:  # the index's own library, raised in a loop over a streamed batch
            damage = self.ctx.index.translate_error(exc)
            if damage is None:
                raise
            out.append(Finding("unreadable-index", "index", f"verify stopped: {type(damage).__name__}: {damage}"))
        return out


def _quarantine_findings(ctx: StoreContext, out: list[Finding]) -> None:
    for key, raw in ctx.index.scan("quarantine"):
        session = keys.session_of_key(key)
        try:
            sid_hex, reason, *_objects = msgspec.msgpack.decode(raw)
        except (msgspec.DecodeError, ValueError, TypeError):
            sid_hex, reason = "?", "(the quarantine record itself is damaged)"
        out.append(Finding("quarantined", f"snapshot {sid_hex} (session {session!r})",
                           f"quarantined: {reason}; its bytes are kept as evidence until an operator drops it "
                           f"(Store.drop_quarantined / delete)", (session,)))


def _verify(v: Verifier, deep: bool, out: list[Finding], mark_bad: bool = True) -> None:
    """Streamed (``verifying`` says how memory stays bounded and why a concurrent commit invents nothing): the
    manifests in batches, each checked against its other records inside its batch's read transaction and any
    finding re-checked in a fresh one; then session pointers; then the counts (``verify_counts.check_counts``); then
    crash residue, confirmed under the exclusive save gate."""
    ctx = v.ctx
    residue = orphans(ctx.index, ctx.bytes, v.reclaimer.leased_objects())  # listed first, confirmed last
    _quarantine_findings(ctx, out)
    tally = verify_counts.Tally(verify_counts.partitions(ctx.index))
    for txn, rows in ctx.index.batches("manifests", verify_counts.VERIFY_BATCH):
        tally.txn_ids.add(txn.id())
        tally.manifests += len(rows)
        suspects = []
        for sid, raw in rows:
            found = _check_manifest(ctx, txn, sid, raw, deep, tally)
            if found:
                suspects.append((sid, found))
        for sid, found in suspects:  # after the batch's transaction: again from a fresh read of the snapshot
            out.extend(_recheck_manifest(ctx, sid, deep, found))
        seams.AFTER_BATCH()  # a test may make another process commit exactly here
    for txn, rows in ctx.index.batches("sessions", verify_counts.VERIFY_BATCH):
        for key, sid in rows:
            if txn.get("manifests", sid) is None:
                out.append(Finding("dangling-session", keys.session_of_key(key), f"-> {sid.hex()}"))
            elif tables.orphan_checkpoint(txn, key):
                owner = (keys.parent_of(keys.session_of_key(key)) or ("?",))[0]
                out.append(Finding("orphan-checkpoint", f"snapshot {sid.hex()} (checkpoint of session {owner!r})",
                                   "its session is not indexed, so no removal of the session will take it along; "
                                   "`kvshelf repair` drops it", (owner,)))
    for txn, rows in ctx.index.batches("heads", verify_counts.VERIFY_BATCH):  # one head per session, each indexed
        tally.head_records += len(rows)
        for lineage, sid in rows:
            if txn.get("manifests", sid) is None:
                out.append(Finding("prefix-drift", "prefix heads",
                                   f"head {lineage.hex()} names no indexed snapshot ({sid.hex()})"))
    verify_counts.check_counts(ctx, deep, tally, out, mark_bad)
    for name, kind in _confirmed_orphans(v, residue):
        what = "manifest" if kind == "orphan-manifest" else "pack" if is_pack(name) else "v1 chunk file"
        out.append(Finding(kind, f"{what} {name}",
                           "unreferenced: no index record names it (left by a re-save, a quarantine drop or a "
                           "crash; `kvshelf gc` reclaims it)"))
    out[:] = _trailer_findings(out)


def _plain(detail: str, pack: str) -> str:
    for prefix in (f"pack {pack}: ", f"pack {pack} "):
        if detail.startswith(prefix):
            return detail[len(prefix):]
    return detail


def _trailer_findings(out: list[Finding]) -> list[Finding]:
    """One finding per pack with a damaged trailer (a snapshot's check and the pack check may both see it), naming
    every session a rebuild from packs would lose."""
    merged: dict[str, tuple[str, set[str]]] = {}
    rest = []
    for f in out:
        if f.kind == "damaged-trailer":
            detail, sessions = merged.get(f.where, (f.detail, set()))
            merged[f.where] = (detail, sessions | set(f.sessions))
        else:
            rest.append(f)
    for where, (detail, sessions) in merged.items():
        who = ", ".join(repr(s) for s in sorted(sessions)) or "none"
        rest.append(Finding("damaged-trailer", where, f"its trailer is damaged ({detail}): a rebuild from "
                            f"packs would lose sessions {who}; run `kvshelf repair`", tuple(sorted(sessions))))
    return rest


def _recheck_manifest(ctx: StoreContext, sid: bytes, deep: bool, found: list[Finding]) -> list[Finding]:
    """The findings of one snapshot that hold again in a fresh read transaction (its pack may have been unlinked
    after a delete committed, or its manifest rewritten by compaction, since the batch was read)."""
    with ctx.index.read() as txn:
        raw = txn.get("manifests", sid)
        again = [] if raw is None else _check_manifest(ctx, txn, sid, raw, deep, None)
    first = {(f.kind, f.where) for f in found}
    return [f for f in again if (f.kind, f.where) in first]


def _check_manifest(ctx: StoreContext, txn, sid: bytes, raw: bytes, deep: bool, tally) -> list[Finding]:
    """Every finding about one snapshot, read in ``txn``; counts it into ``tally`` (None: a re-check)."""
    out: list[Finding] = []
    if len(sid) != 16:  # a damaged key: it names no snapshot, and LMDB refuses some lengths as keys
        return [Finding("bad-manifest", f"manifest record under key {sid.hex()!r}", f"its key is {len(sid)} bytes, "
                        f"not a 16-byte snapshot id (damaged)")]
    try:
        m = schema.decode(raw, Manifest, f"manifest {sid.hex()}")
    except (CorruptData, IncompatibleFormat) as exc:
        try:
            who = (schema.decode(txn.get("summaries", sid) or b"", Summary, "summary").session_id,)
        except CorruptData:
            who = ()
        return [Finding("bad-manifest", f"snapshot {sid.hex()}" + (f" (session {who[0]!r})" if who else ""),
                        str(exc), who)]
    where = f"snapshot {sid.hex()} (session {m.session_id!r})"
    idk, nsk, skey = keys.manifest_keys(m)
    raw = txn.get("summaries", sid)
    if raw is None:
        return [Finding("missing-summary", where, "no summary record", (m.session_id,))]
    try:
        s = schema.decode(raw, Summary, "summary")
    except CorruptData as exc:
        return [Finding("bad-summary", where, str(exc), (m.session_id,))]
    if (s.id_key, s.ns_key, s.session_id, s.length, s.nbytes) != (idk, nsk, m.session_id, m.length, m.nbytes):
        out.append(Finding("summary-drift", where, "summary disagrees with the manifest"))
    tokens = np.asarray(m.tokens, "<i8")
    toks = txn.get("tokens", sid)
    try:
        same = toks is not None and np.array_equal(schema.tokens_of(toks, "tokens record"), tokens)
    except CorruptData:
        same = False
    if not same:
        out.append(Finding("tokens-drift", where, "stored tokens differ from the manifest (or fail their checksum)"))
    head = txn.get("sessions", skey) == sid  # the session's current snapshot (else a stale one)
    if not head:
        out.append(Finding("stale-snapshot", where, "its session points elsewhere"))
    if txn.get("lru", keys.lru_key(idk, s.last_used_ns, sid)) is None:
        out.append(Finding("lru-drift", where, "no LRU record"))
    n_records = 0
    if head:  # its records are in the prefix table (records.py); a stale snapshot's are not
        n_records, problems = records.check_head(txn, skey, sid, tokens, ctx.block)
        out.extend(Finding("prefix-drift", where, p) for p in problems)
    if tally is not None:
        tally.count(m, s, n_records, head=head)
    try:
        on_disk = _manifest_on_disk(ctx.bytes, sid.hex(), s)
    except DamagedTrailer as exc:
        out.append(Finding("damaged-trailer", f"pack {s.pack}", str(exc)))
        on_disk = b""
    if on_disk == b"":
        pass
    elif on_disk is None:
        out.append(Finding("missing-manifest-file", where, "its manifest is on disk in no pack or file"))
    else:
        # an index not yet sealed (a v1 store only ever opened read-only since) is not damage: the owner's next
        # open seals its files (legacy_v1.py); only a file left unsealed by that pass is one rebuild would skip
        if not s.pack and not schema.is_sealed(on_disk) and txn.get("meta", SEALED_KEY) is not None:
            out.append(Finding("unsealed-manifest-file", where, "its v1 manifest file carries no checksum (it "
                                                                "disagreed with the index when the store was "
                                                                "sealed): rebuild_index would leave it out"))
        if deep:
            try:
                same = schema.decode(on_disk, Manifest, "manifest on disk") == m
            except (CorruptData, IncompatibleFormat):
                same = False
            if not same:
                out.append(Finding("manifest-file-drift", where, "the manifest on disk differs from the index"))
    return [Finding(f.kind, f.where, f.detail, (m.session_id,)) for f in out]


def _confirmed_orphans(v: Verifier, found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The orphans listed before verify's passes that are still dead, unleased and present after them, looked at
    with the removers' lock and the save gate held exclusively: no delete, eviction or lease release is then between
    its commit and the unlink of what it freed (``liveness/removers_lock.py``), and no save between writing its pack and committing
    it — so what is still dead and present has no remover: crash residue. Removers or saves keeping the locks busy
    for 10 s leave them unconfirmed and unreported this round (``gc`` skips its sweep the same way)."""
    if not found:
        return []
    seams.BEFORE_CONFIRM()
    ctx = v.ctx
    with ctx.removers.quiescent(timeout=10.0) as quiet:
        if not quiet:
            return []
        try:
            with v.gate.hold(exclusive=True, timeout=10.0):
                leased = v.reclaimer.leased_objects()
                index = ctx.index
                with index.read() as txn:
                    kept = leased | quarantined_objects(index, txn)
                    return [(name, kind) for name, kind in found
                            if (obj := object_of(ctx.bytes, name, kind)) is not None and obj not in kept
                            and not ledger.object_live(index, txn, obj) and ctx.bytes.exists(obj)]
        except StoreBusy:
            return []



__all__ = ["Verifier"]
