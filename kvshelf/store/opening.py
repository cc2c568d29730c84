"""Opening a store directory: the order a handle's open must follow, in one place.

Why its own module: opening reaches everything below the rooms — directories and their modes, the locks, the byte
store, the reaping of interrupted writes, LMDB and its format upgrade — while the ``StoreContext`` it returns is plain
shared state that every collaborator imports for its type. Keeping the two apart keeps LMDB out of what a
collaborator reaches.

``open_context`` makes the directory (0700, new) or probes an existing one (never chmod-ed; read-only when this
process cannot write it), takes the per-process open lock before LMDB maps the index, reaps interrupted writes and
opens the index (an older format is upgraded by ``index.lmdb_env`` in one write transaction, or read as it is by a
read-only handle). ``close_context`` undoes it, in the reverse order.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from ..codecs import CodecProvider
from ..errors import EncryptionKeyError, FileAccessError, FileMissing, KvShelfError, file_error
from .base.syncs import ensure_dir
from .context import StoreContext
from .identity import Identity
from .index.lmdb_env import Index
from .index.protocol import IndexStore
from .liveness import object_locks, open_lock
from .liveness.access import Access, probe
from .liveness.lease_files import LeaseBook
from .liveness.removers_lock import RemoversLock
from .liveness.save_gate import SaveGate
from .objects.local import LocalByteStore
from .objects.protocol import ByteStore, capability
from .objects.sealing import KeyRing
from .prefix import records


def open_context(path, identity: Identity | None, provider: CodecProvider, byte_store: ByteStore | None,
                 index_store: IndexStore | None, map_size: int, **options: Any) -> tuple[StoreContext, SaveGate]:
    """Make the directory, its locks and (by default) its byte store, take the per-process open lock, reap
    interrupted writes and open the index. Returns the context and the store's save gate. A new directory is made
    0700; an existing one is opened as it is (never chmod-ed), and read-only when this process cannot write it
    (``_open_read_only``). An ``OSError`` on the way (a store this process may not even read, a parent it may not
    create in) leaves as a ``FileAccessError`` naming the path and the open."""
    root = os.path.abspath(os.fspath(path))
    key = options.pop("key", None)
    try:
        keys = open_keys(root, key, blind=identity is None)  # before any lock: a wrong key leaves nothing held
        ctx, gate = _open(root, identity, provider, byte_store, index_store, map_size, **options)
        ctx.keys = keys
        return ctx, gate
    except KvShelfError:
        raise
    except OSError as exc:
        raise file_error(exc, f"opening the store at {root}") from exc


def open_keys(root: str, key: Any, *, blind: bool) -> KeyRing | None:
    """The store's ``KeyRing`` (encryption at rest, ``objects/sealing.py``): opened with ``key`` (the first keyed
    open of a store makes it encrypted), or None for a plaintext store opened without one. An encrypted store opened
    without its key: ``EncryptionKeyError`` naming it — except identity-blind (offline tools), which get a locked
    ring: what needs no plaintext works, a chunk read says it needs the key."""
    if key is not None:
        return KeyRing.open(root, key)
    if not KeyRing.encrypted(root):
        return None
    if blind:
        return KeyRing.locked(root)
    raise EncryptionKeyError(f"the store at {root} is encrypted at rest: open it with its key "
                             f"(open_store(..., key=...), kvshelf serve --encryption-key-file)")


def close_context(ctx: StoreContext) -> None:
    """The last step of a handle's close, after its collaborators have finished: leases, index, open lock."""
    ctx.closed = True
    try:
        ctx.leases.close()
        ctx.index.close()
    finally:
        open_lock.release(ctx.lock_key)


def _open(root: str, identity: Identity | None, provider: CodecProvider, byte_store: ByteStore | None,
          index_store: IndexStore | None, map_size: int, **options: Any) -> tuple[StoreContext, SaveGate]:
    if os.path.isdir(root):
        access = probe(root)  # an existing store is opened as it is: never chmod-ed (liveness/access.py)
    else:
        ensure_dir(root)  # a new store: 0700 directories, 0600 files
        access = Access(root)
    if access.read_only:
        return _open_read_only(root, access, identity, provider, byte_store, index_store, map_size, **options)
    objects = byte_store if byte_store is not None else LocalByteStore(root, os.path.join(root, "tmp"))
    if capability(objects, "local_paths"):
        ensure_dir(objects.path("packs"))  # made once here, not inside a save (its own fsync)
    lock_dir = os.path.join(root, "locks")
    ensure_dir(lock_dir)
    gate = SaveGate(os.path.join(lock_dir, "save.lock"), root)
    removers = RemoversLock(os.path.join(lock_dir, "removers.lock"))
    object_locks.make_sentinel(root)
    lock_key = os.path.realpath(root)
    open_lock.acquire(lock_key)  # before LMDB maps the index: "open" is exact (open_lock.py)
    try:
        if capability(objects, "reaps_tmp"):
            objects.reap_tmp()
        index = index_store if index_store is not None else Index(os.path.join(root, "index"), map_size=map_size,
                                                                   retag_prefix_records=records.rebuild_table)
    except BaseException:
        open_lock.release(lock_key)
        raise
    return StoreContext(root, identity, provider, index, objects, LeaseBook(root), removers, lock_key, **options,
                        access=access), gate


def _open_read_only(root: str, access: Access, identity, provider, byte_store, index_store, map_size,
                    **options: Any) -> tuple[StoreContext, SaveGate]:
    """The open of a store this process cannot write: nothing is created, locked for writing, reaped or changed.
    The open lock is taken shared where its file exists (an offline job of the owner still excludes this reader);
    the index opens read-only; the gate and the removers' lock refuse (liveness/access.py says what is given up and
    why it is safe)."""
    try:
        os.listdir(root)  # what the open reads next: a store this process may not even read says so
    except PermissionError as exc:
        raise FileAccessError(errno.EACCES, f"cannot open the store at {root}: no read permission for uid "
                              f"{os.geteuid()}", root) from exc
    if not os.path.isdir(os.path.join(root, "index")) and index_store is None:
        raise FileMissing(errno.ENOENT, f"no kvshelf store at {root} (no index/), and it cannot be created: "
                          f"{access.reason}", os.path.join(root, "index"))
    objects = byte_store if byte_store is not None else LocalByteStore(root, os.path.join(root, "tmp"), create=False)
    lock_dir = os.path.join(root, "locks")
    gate = SaveGate(os.path.join(lock_dir, "save.lock"), root, access=access)
    removers = RemoversLock(os.path.join(lock_dir, "removers.lock"), access=access)
    lock_key = os.path.realpath(root)
    open_lock.acquire(lock_key, read_only=True)
    try:
        index = index_store if index_store is not None else Index(os.path.join(root, "index"), map_size=map_size,
                                                                   access=access,
                                                                   retag_prefix_records=records.rebuild_table)
    except BaseException:
        open_lock.release(lock_key)
        raise
    return StoreContext(root, identity, provider, index, objects, LeaseBook(root, access=access), removers, lock_key,
                        **options, access=access), gate


__all__ = ["close_context", "open_context"]
