"""A handle's write transactions, its readers' leases, and the one place objects are unlinked.

Why together: unlinking is safe only under three rules at once — the object is no longer live in the ledger
(re-checked inside the unlinking write transaction, so under LMDB's writer lock no saver can commit a reference to
it meanwhile), no live lease names it (``leases.py``: kernel-released locks, no PID), and it is the byte store's to
remove. Leases are taken without any commit (no fsync on the read path); uses of snapshots (LRU order, last-used
times) are remembered in memory and written by the handle's next write transaction (a save, a delete, close, or a
timer a few seconds later — a background commit, never inside a restore).

A full disk never blocks a read: a lease the lease file has no room for is held in memory and the read is protected
by object locks instead (``objlocks.py``: kernel locks, no byte of disk). Every unlink asks ``_leased_objects``, whose
answer also holds every object a reader has locked. Eviction and compaction, which pick *what* to drop or rewrite
from the published leases, may then pick a snapshot another handle is reading that way; its bytes stay on disk (the
unlink is refused while the lock is held) and are reclaimed by that reader's release or a later ``gc``.
The lease files are read *inside* the transaction that decides what is dead (after the deaths it acts on committed),
so a reader that published or locked later re-checks after those deaths too and gives up instead of reading.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

from ...errors import SnapshotNotFound
from ..index import keys, ledger
from ..index import schema as mf
from ...errors import StoreFull
from ..index.tables import quarantined_objects
from .lease_files import Unknown
from .object_locks import LeasedObjects, lock_objects, prober
from ..index.schema import BlobRef, ChunkMeta, Lease, Manifest, Summary

TOUCH_FLUSH_SECONDS = 2.0


class Gone(Exception):
    pass


class Stale(SnapshotNotFound):
    """The manifest in hand names chunks the snapshot no longer references (it was rewritten in place)."""


class LeasingMixin:
    """Mixed into ``Store``: needs ``index``, ``bytes``, ``leases``, ``_lock``, ``lease_seconds``, ``_closing``."""

    def _init_leasing(self) -> None:
        self._lease_counter = 0
        self._touches: dict[bytes, tuple[int, list[str]]] = {}  # sid -> (when, hashes) not yet written
        self._touch_timer: threading.Timer | None = None
        self._forget: set[str] = set()  # packs unlinked whose emptied records the next write transaction drops
        self._read_locks: dict = {}  # lease key -> objlocks.ReadLocks, for leases the lease file had no room for

    # ------------------------------------------------------------------ write transactions
    def _txn(self, fn, unlink: Sequence[str] = ()):
        """One write transaction of this handle: remembered uses first, then unlinking the objects among ``unlink``
        that are dead and unleased (leases read under the writer lock), then ``fn``. On a full disk the uses are
        dropped from it and it is tried once more: an LRU order is never worth a failed delete or gc."""
        with self._lock:
            touches, self._touches = self._touches, {}
            forget, self._forget = self._forget, set()

        def run(txn, touches):
            for sid, (when, hashes) in touches.items():
                self._apply_touch(txn, sid, when, hashes)
            for name in forget:  # packs unlinked by _reclaim: drop their (emptied) records
                if not ledger.object_live(self.index, txn, name):
                    ledger.forget_pack(self.index, txn, name)
            if unlink:
                try:
                    leased = self._leased_objects() | quarantined_objects(self.index, txn)
                except Unknown:
                    leased = None
                for name in unlink if leased is not None else ():
                    if name not in leased and not ledger.object_live(self.index, txn, name):
                        self.bytes.delete(name)
                        ledger.forget_pack(self.index, txn, name)
            return fn(txn)

        try:
            try:
                return self.index.write(lambda txn: run(txn, touches))
            except StoreFull:
                if not touches:
                    raise
                result = self.index.write(lambda txn: run(txn, {}))
                touches = {}  # not written, and not worth keeping on a full disk
                return result
        except BaseException:
            with self._lock:  # not written: keep them for the next transaction
                for sid, item in touches.items():
                    self._touches.setdefault(sid, item)
                self._forget.update(forget)
            raise

    def _reclaim(self, names: Sequence[str]) -> None:
        """Unlink the objects among ``names`` that are dead in the ledger and unleased — no write transaction (no
        fsync): a dead object never becomes live again (only the writer of a fresh pack, or an offline rebuild,
        indexes chunks into an object), and the lease files are read after the drop committed, so a reader either
        is seen here or sees the chunks gone. Emptied pack records are forgotten by the next write transaction."""
        names = [n for n in dict.fromkeys(names) if n]
        if not names:
            return
        with self.index.read() as txn:  # leases read after this snapshot began: see the module docstring
            try:
                leased = self._leased_objects()
            except Unknown:
                return  # a live handle's lease file is unreadable right now: unlink nothing this time (gc will)
            leased = leased | quarantined_objects(self.index, txn)  # a quarantined snapshot's evidence stays
            dead = [n for n in names if n not in leased and not ledger.object_live(self.index, txn, n)]
        for name in dead:
            self.bytes.delete(name)
        with self._lock:
            self._forget.update(n for n in dead if keys.is_pack(n))

    def _leased_objects(self) -> LeasedObjects:
        """Objects no unlinker may remove: those live leases name, and (asked per name) those a reader on a full disk
        holds a lock on (``objlocks.py``). Call it after the deaths the caller acts on have committed."""
        out: set[str] = set()
        for lease in self.leases.live():
            out.update(lease.objects)
        return LeasedObjects(out, prober(self.root, getattr(self.bytes, "path", None)))

    def _live_leases(self, txn=None) -> tuple[set[str], set[str]]:
        """(snapshot ids, chunk hashes) held by live leases of every handle."""
        sids, hashes = set(), set()
        for lease in self.leases.live():
            sids.add(lease.snapshot_id)
            hashes.update(lease.hashes)
        return sids, hashes

    # ------------------------------------------------------------------ leases
    def _locate(self, txn, manifest: Manifest, refs: list[BlobRef]) -> dict[str, tuple[str, int, int | None]]:
        if txn.get("manifests", bytes.fromhex(manifest.snapshot_id)) is None:
            raise Gone
        where = {}
        for r in refs:
            raw = txn.get("chunks", bytes.fromhex(r.hash))
            if raw is None:  # unreferenced: maybe already unlinked (the manifest in hand was rewritten since)
                raise Stale(f"snapshot {manifest.snapshot_id} of session {manifest.session_id!r} was rewritten "
                            f"(compacted) after its manifest was read")
            where[r.hash] = keys.location(r.hash, mf.decode(raw, ChunkMeta, f"chunk record {r.hash}"))
        return where

    def _lease(self, manifest: Manifest, refs: list[BlobRef],
               with_where: bool = False):
        """Publish a lease on ``refs`` (and the objects they lie in), then check in a fresh read transaction that
        they are all still referenced where we looked them up. No commit, no fsync."""
        with self._lock:
            self._lease_counter += 1
            key = keys.be64(os.getpid()) + keys.be64(self._lease_counter)
        try:
            for _attempt in range(8):
                with self.index.read() as txn:
                    where = self._locate(txn, manifest, refs)
                objects = sorted({w[0] for w in where.values()})
                if not self.leases.add(key, Lease(os.getpid(), time.time() + self.lease_seconds,
                                                  manifest.snapshot_id, [r.hash for r in refs], objects)):
                    self._lock_objects(key, objects)  # no room to publish it: lock the objects instead
                with self.index.read() as txn:
                    again = self._locate(txn, manifest, refs)
                if again == where:
                    return (key, where) if with_where else key
            raise Stale(f"chunks of snapshot {manifest.snapshot_id} kept moving while being leased")
        except Gone:
            self._drop_lease(key)
            raise SnapshotNotFound(f"snapshot {manifest.snapshot_id} of session {manifest.session_id!r} was "
                                   f"removed before it could be read") from None
        except BaseException:
            self._drop_lease(key)
            raise

    def _lock_objects(self, key: bytes, objects: Sequence[str]) -> None:
        """Protect a lease the disk had no room to publish with read locks on its objects (``objlocks.py``)."""
        self._unlock_objects(key)  # a retry of _lease: the objects may have moved
        path_of = getattr(self.bytes, "path", None)
        if path_of is None:
            raise StoreFull(f"no room to publish a reader's lease in {self.leases.dir}, and this byte store has no "
                            f"files to lock instead")
        try:
            locks = lock_objects(self.root, [path_of(name) for name in objects])
        except OSError as exc:
            raise StoreFull(f"no room to publish a reader's lease in {self.leases.dir}, and its objects could not "
                            f"be locked instead ({exc})") from exc
        with self._lock:
            self._read_locks[key] = locks

    def _unlock_objects(self, key: bytes) -> None:
        with self._lock:
            locks = self._read_locks.pop(key, None)
        if locks is not None:
            locks.close()

    def _drop_lease(self, key: bytes):
        try:
            return self.leases.remove(key)
        finally:
            self._unlock_objects(key)

    def _release(self, key: bytes, touch: bytes | None, refs: Sequence[BlobRef | str]) -> None:
        """Drop a lease (no commit). A use (``touch``) is remembered for the next write transaction. Objects of the
        lease that lost their last reference while it was held are unlinked now (only then is there a commit)."""
        with self.removers.removing():  # from the lease's end to the unlink of what it kept alive (removers.py)
            self._release_held(key, touch, refs)

    def _release_held(self, key: bytes, touch: bytes | None, refs: Sequence[BlobRef | str]) -> None:
        lease = self._drop_lease(key)  # locks go before the reclaim below, which must not see our own
        hashes = [r if isinstance(r, str) else r.hash for r in refs]
        if touch is not None:
            with self._lock:
                self._touches[touch] = (time.time_ns(), hashes)
                if self._touch_timer is None and not self._closing:
                    self._touch_timer = threading.Timer(TOUCH_FLUSH_SECONDS, self._flush_touches)
                    self._touch_timer.daemon = True
                    self._touch_timer.start()
        if lease is not None and refs and lease.objects:
            with self.index.read() as txn:
                dead = [n for n in lease.objects if not ledger.object_live(self.index, txn, n)]
            if dead and any(self.bytes.exists(n) for n in dead):
                self._reclaim(dead)

    def _touched(self) -> dict[bytes, int]:
        """Uses not yet written, seen by this handle's lookups and eviction."""
        with self._lock:
            return {sid: when for sid, (when, _h) in self._touches.items()}

    def _flush_touches(self) -> None:
        # Never hold self._lock across a transaction: transaction bodies take it (lock order: index, then store).
        with self._lock:
            self._touch_timer = None
            go = bool(self._touches) and not self._closing
        if go:
            try:
                self._txn(lambda txn: None)
            except Exception:  # pragma: no cover - retried by the next write of this handle
                pass

    def _apply_touch(self, txn, sid: bytes, now: int, hashes: list[str]) -> None:
        raw = txn.get("summaries", sid)
        if raw is None:
            return
        s = mf.decode(raw, Summary, "summary")
        txn.delete("lru", keys.lru_key(s.id_key, s.last_used_ns, sid))
        txn.put("lru", keys.lru_key(s.id_key, now, sid), b"")
        txn.put("summaries", sid, mf.encode(Summary(s.id_key, s.ns_key, s.session_id, s.namespace, s.length,
                                       s.minimum_reusable_offset, s.trimmable, s.nbytes, s.created_at, now, s.pack)))
        for h in hashes:
            k = bytes.fromhex(h)
            raw = txn.get("chunks", k)
            if raw is not None:
                m = mf.decode(raw, ChunkMeta, "chunk record")
                txn.put("chunks", k, mf.encode(ChunkMeta(m.refs, m.nbytes, m.stored_bytes, m.encoding, now, m.pack,
                                               m.offset)))


__all__ = ["Gone", "LeasingMixin", "Stale", "TOUCH_FLUSH_SECONDS"]
