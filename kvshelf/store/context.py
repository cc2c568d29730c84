"""What every collaborator of a ``Store`` handle shares: one explicit context instead of attributes on a mixin.

Why: a collaborator (``liveness``, ``space``, ``save``, ``restore``, ``integrity``, ``admin``) receives the context
plus the other collaborators it calls in its constructor, so what each part needs is stated in code. The context
holds only what is the handle's and not any one part's: where the store is, under which identity it was opened, the
two seams (``index``, ``bytes``), the lease files and the removers' lock, the options, the counters, the handle's
lock, the shared tier and ``access`` (whether this process may write the store: ``access.py``; an open never
changes the store's permissions, and a store it cannot write opens read-only). ``index`` changes after open (``admin``'s ``replace_index`` swaps the LMDB environment),
``tier`` when one is bound: collaborators read ``ctx.index`` / ``ctx.tier`` at each use and never keep their own
reference.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..codecs import CodecProvider
from ..errors import FileAccessError, FileMissing, KvShelfError, file_error
from .access import Access, probe
from .identity import Identity
from .index.lmdb_env import Index
from .prefix import records
from .index.protocol import IndexStore
from .liveness import object_locks as objlocks, open_lock as openlock
from .liveness.lease_files import LeaseBook
from .liveness.removers_lock import RemoversLock
from .liveness.save_gate import SaveGate
from .objects.local import LocalByteStore, ensure_dir
from .objects.protocol import ByteStore, capability


@dataclass
class Counters:
    """The handle's work counters (tests count work here, never time). Typed fields for the code that counts
    (``ctx.counters.hits += 1``), and a mapping face for what reads them by name: ``store.counters["hits"]``,
    ``dict(store.counters)`` and ``stats()``, which spreads them (``**store.counters``). Keys are the field names;
    no key can be added or removed. Like the dict it replaces, it is not locked: counts of concurrent calls are
    best effort."""

    blobs_read: int = 0
    bytes_read: int = 0
    blobs_written: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    lookups: int = 0
    hits: int = 0
    quarantined: int = 0
    evicted: int = 0
    batch_layers_direct: int = 0
    batch_layers_fallback: int = 0
    chunks_hashed: int = 0
    bytes_hashed: int = 0
    chunks_hash_reused: int = 0
    bytes_hash_reused: int = 0

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, name: str) -> int:
        if name not in _NAMES:
            raise KeyError(name)
        return getattr(self, name)

    def __setitem__(self, name: str, value: int) -> None:
        if name not in _NAMES:
            raise KeyError(name)
        setattr(self, name, value)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(_NAMES)

    def __contains__(self, name: object) -> bool:
        return name in _NAMES

    def items(self) -> list[tuple[str, int]]:
        return [(name, getattr(self, name)) for name in self.keys()]

    def values(self) -> list[int]:
        return [getattr(self, name) for name in self.keys()]

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in _NAMES else default


_NAMES = frozenset(f.name for f in dataclasses.fields(Counters))


@dataclass
class StoreContext:
    """One handle's shared state (module docstring). Built by ``Store.__init__`` once the index is open."""

    root: str
    identity: Identity | None  # None: an identity-blind handle for offline tools
    provider: CodecProvider
    index: IndexStore  # replaced only by admin's index swap, under the exclusive hold
    bytes: ByteStore
    leases: LeaseBook  # every handle's lease files (liveness/lease_files.py)
    removers: RemoversLock
    lock_key: str  # the store's identity for the per-process open lock (open_lock.py)
    chunk_tokens: int = 256
    verify_reads: bool = True
    max_bytes: int | None = None
    lease_seconds: float = 600.0
    block: int = 16  # prefix records' block size (prefix/hashing.py)
    counters: Counters = field(default_factory=Counters)
    lock: threading.RLock = field(default_factory=threading.RLock)  # the handle's own lock: never held across an
    # index transaction (transaction bodies take it)
    closed: bool = False
    tier: Any = None  # the shared tier (remote/tier.py), bound by open_store(remote=...): restores fall back on it
    access: Access | None = None  # whether this process may write the store (access.py); None: writable

    @property
    def read_only(self) -> bool:
        return self.access is not None and self.access.read_only

    def check_writable(self, what: str) -> None:
        """``StoreReadOnly`` (naming ``what``, the path and the missing permission) on a read-only handle."""
        if self.access is not None:
            self.access.check(what)

    @property
    def id_key(self) -> bytes | None:
        return self.identity.key if self.identity is not None else None

    @property
    def identity_blind(self) -> bool:
        return self.identity is None

    @classmethod
    def open(cls, path, identity: Identity | None, provider: CodecProvider, byte_store: ByteStore | None,
             index_store: IndexStore | None, map_size: int, **options: Any) -> tuple[StoreContext, SaveGate]:
        """Make the directory, its locks and (by default) its byte store, take the per-process open lock, reap
        interrupted writes and open the index: the order a handle's open must follow. Returns the context and the
        store's save gate. A new directory is made 0700; an existing one is opened as it is (never chmod-ed), and
        read-only when this process cannot write it (``_open_read_only``). An ``OSError`` on the way (a store this
        process may not even read, a parent it may not create in) leaves as a ``FileAccessError`` naming the path
        and the open."""
        root = os.path.abspath(os.fspath(path))
        try:
            return cls._open(root, identity, provider, byte_store, index_store, map_size, **options)
        except KvShelfError:
            raise
        except OSError as exc:
            raise file_error(exc, f"opening the store at {root}") from exc

    @classmethod
    def _open(cls, root: str, identity: Identity | None, provider: CodecProvider, byte_store: ByteStore | None,
              index_store: IndexStore | None, map_size: int, **options: Any) -> tuple[StoreContext, SaveGate]:
        if os.path.isdir(root):
            access = probe(root)  # an existing store is opened as it is: never chmod-ed (access.py)
        else:
            ensure_dir(root)  # a new store: 0700 directories, 0600 files
            access = Access(root)
        if access.read_only:
            return cls._open_read_only(root, access, identity, provider, byte_store, index_store, map_size, **options)
        objects = byte_store if byte_store is not None else LocalByteStore(root, os.path.join(root, "tmp"))
        if capability(objects, "local_paths"):
            ensure_dir(objects.path("packs"))  # made once here, not inside a save (its own fsync)
        lock_dir = os.path.join(root, "locks")
        ensure_dir(lock_dir)
        gate = SaveGate(os.path.join(lock_dir, "save.lock"), root)
        removers = RemoversLock(os.path.join(lock_dir, "removers.lock"))
        objlocks.make_sentinel(root)
        lock_key = os.path.realpath(root)
        openlock.acquire(lock_key)  # before LMDB maps the index: "open" is exact (open_lock.py)
        try:
            if capability(objects, "reaps_tmp"):
                objects.reap_tmp()
            index = index_store if index_store is not None else Index(os.path.join(root, "index"), map_size=map_size,
                                                                       retag_prefix_records=records.rebuild_table)
        except BaseException:
            openlock.release(lock_key)
            raise
        return cls(root, identity, provider, index, objects, LeaseBook(root), removers, lock_key, **options,
                   access=access), gate

    @classmethod
    def _open_read_only(cls, root: str, access: Access, identity, provider, byte_store, index_store, map_size,
                        **options: Any) -> tuple[StoreContext, SaveGate]:
        """The open of a store this process cannot write: nothing is created, locked for writing, reaped or changed.
        The open lock is taken shared where its file exists (an offline job of the owner still excludes this
        reader); the index opens read-only; the gate and the removers' lock refuse (access.py says what is given
        up and why it is safe)."""
        try:
            os.listdir(root)  # what the open reads next: a store this process may not even read says so
        except PermissionError as exc:
            raise FileAccessError(errno.EACCES, f"cannot open the store at {root}: no read permission for uid "
                                  f"{os.geteuid()}", root) from exc
        if not os.path.isdir(os.path.join(root, "index")) and index_store is None:
            raise FileMissing(errno.ENOENT, f"no kvshelf store at {root} (no index/), and it cannot be created: "
                              f"{access.reason}", os.path.join(root, "index"))
        objects = byte_store if byte_store is not None else LocalByteStore(root, os.path.join(root, "tmp"),
                                                                           create=False)
        lock_dir = os.path.join(root, "locks")
        gate = SaveGate(os.path.join(lock_dir, "save.lock"), root, access=access)
        removers = RemoversLock(os.path.join(lock_dir, "removers.lock"), access=access)
        lock_key = os.path.realpath(root)
        openlock.acquire(lock_key, read_only=True)
        try:
            index = index_store if index_store is not None else Index(os.path.join(root, "index"),
                                                                       map_size=map_size, access=access,
                                                                       retag_prefix_records=records.rebuild_table)
        except BaseException:
            openlock.release(lock_key)
            raise
        return cls(root, identity, provider, index, objects, LeaseBook(root, access=access), removers, lock_key,
                   **options, access=access), gate

    def check_open(self) -> None:
        if self.closed:
            raise KvShelfError(f"store {self.root} is closed")


__all__ = ["Counters", "StoreContext"]
