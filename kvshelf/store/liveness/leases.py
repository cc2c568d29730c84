"""Readers' leases: what a restore (or a tool, or the shared tier's publisher) holds while it reads chunks.

A lease is published in the lease files (``lease_files.py``) without any commit (no fsync on the read path), then
the chunks are looked up again in a fresh read transaction: they must all still be referenced where they were
found. A full disk never blocks a read: a lease the lease file has no room for is held in memory and the read is
protected by object locks instead (``object_locks.py``: kernel locks, no byte of disk). Every unlink asks
``Reclaimer.leased_objects``, whose answer also holds every object a reader has locked. Releasing a lease remembers
the use (``uses.py``) and unlinks what lost its last reference while the lease held it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ...errors import SnapshotNotFound, StoreFull
from ..context import StoreContext
from ..index import keys, tables
from . import ledger
from ..index.schema import ChunkRef, Lease, Manifest
from ..objects.protocol import capability
from .object_locks import lock_objects
from .reclaim import Reclaimer
from .uses import UseBook


class Gone(Exception):
    pass


class Stale(SnapshotNotFound):
    """The manifest in hand names chunks the snapshot no longer references (it was rewritten in place)."""


class Leases:
    """One handle's readers' leases (the lease files themselves are ``ctx.leases``, shared by every handle)."""

    def __init__(self, ctx: StoreContext, reclaimer: Reclaimer, uses: UseBook):
        self.ctx, self.reclaimer, self.uses = ctx, reclaimer, uses
        self._counter = 0
        self._read_locks: dict = {}  # lease key -> objlocks.ReadLocks, for leases the lease file had no room for

    def locate(self, txn, manifest: Manifest, refs: list[ChunkRef]) -> dict[str, tuple[str, int, int | None]]:
        """Where each of ``refs`` lies now; ``Gone`` (the snapshot) or ``Stale`` (a chunk no longer indexed)."""
        if txn.get("manifests", bytes.fromhex(manifest.snapshot_id)) is None:
            raise Gone
        where = {}
        for r in refs:
            meta = tables.chunk_meta(txn, r.hash)
            if meta is None:  # unreferenced: maybe already unlinked (the manifest in hand was rewritten since)
                raise Stale(f"snapshot {manifest.snapshot_id} of session {manifest.session_id!r} was rewritten "
                            f"(compacted) after its manifest was read")
            where[r.hash] = keys.location(r.hash, meta)
        return where

    def take(self, manifest: Manifest, refs: list[ChunkRef], with_where: bool = False):
        """Publish a lease on ``refs`` (and the objects they lie in), then check in a fresh read transaction that
        they are all still referenced where we looked them up. No commit, no fsync. Returns the lease key (and,
        ``with_where``, where each chunk lies)."""
        ctx = self.ctx
        with ctx.lock:
            self._counter += 1
            key = keys.be64(os.getpid()) + keys.be64(self._counter)
        try:
            for _attempt in range(8):
                with ctx.index.read() as txn:
                    where = self.locate(txn, manifest, refs)
                objects = sorted({w[0] for w in where.values()})
                if not ctx.leases.add(key, Lease(os.getpid(), time.time() + ctx.lease_seconds,
                                                 manifest.snapshot_id, [r.hash for r in refs], objects)):
                    self._lock_objects(key, objects)  # no room to publish it: lock the objects instead
                with ctx.index.read() as txn:
                    again = self.locate(txn, manifest, refs)
                if again == where:
                    return (key, where) if with_where else key
            raise Stale(f"chunks of snapshot {manifest.snapshot_id} kept moving while being leased")
        except Gone:
            self._drop(key)
            raise SnapshotNotFound(f"snapshot {manifest.snapshot_id} of session {manifest.session_id!r} was "
                                   f"removed before it could be read") from None
        except BaseException:
            self._drop(key)
            raise

    def _lock_objects(self, key: bytes, objects: Sequence[str]) -> None:
        """Protect a lease the disk had no room to publish with read locks on its objects (``object_locks.py``)."""
        self._unlock_objects(key)  # a retry of take: the objects may have moved
        ctx = self.ctx
        if ctx.read_only and not capability(ctx.bytes, "local_paths"):
            return  # nothing to lock, and this handle may not publish: its reads are hash-checked (access.py)
        if not capability(ctx.bytes, "local_paths"):
            raise StoreFull(f"no room to publish a reader's lease in {ctx.leases.dir}, and this byte store has no "
                            f"files to lock instead")
        try:
            locks = lock_objects(ctx.root, [ctx.bytes.path(name) for name in objects])
        except OSError as exc:
            if ctx.read_only:  # no sentinel in a store made by an older kvshelf: as above
                return
            raise StoreFull(f"no room to publish a reader's lease in {ctx.leases.dir}, and its objects could not "
                            f"be locked instead ({exc})") from exc
        with ctx.lock:
            self._read_locks[key] = locks

    def _unlock_objects(self, key: bytes) -> None:
        with self.ctx.lock:
            locks = self._read_locks.pop(key, None)
        if locks is not None:
            locks.close()

    def _drop(self, key: bytes):
        try:
            return self.ctx.leases.remove(key)
        finally:
            self._unlock_objects(key)

    def release(self, key: bytes, touch: bytes | None, refs: Sequence[ChunkRef | str]) -> None:
        """Drop a lease (no commit). A use (``touch``) is remembered for the next write transaction. Objects of the
        lease that lost their last reference while it was held are unlinked now (by a handle that may write: a
        read-only one only drops the lease)."""
        if self.ctx.read_only:
            self._drop(key)
            return
        with self.ctx.removers.removing():  # from the lease's end to the unlink of what it kept alive (removers.py)
            lease = self._drop(key)  # locks go before the reclaim below, which must not see our own
            hashes = [r if isinstance(r, str) else r.hash for r in refs]
            if touch is not None:
                self.uses.remember(touch, hashes)
            if lease is not None and refs and lease.objects:
                index = self.ctx.index
                with index.read() as txn:
                    dead = [n for n in lease.objects if not ledger.object_live(index, txn, n)]
                if dead and any(self.ctx.bytes.exists(n) for n in dead):
                    self.reclaimer.reclaim(dead)


__all__ = ["Gone", "Leases", "Stale"]
