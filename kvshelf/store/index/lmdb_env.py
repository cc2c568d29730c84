"""The LMDB index: one environment, named sub-databases, one write transaction per logical change.

Sub-databases (keys are raw bytes; ``sid`` = 16-byte snapshot id, ``idk``/``nsk`` = 16-byte identity / namespace keys):

=============  ==========================================  ==============================================
name           key                                         value
=============  ==========================================  ==============================================
meta           ascii name                                  format version, block size, total stored bytes
manifests      sid                                         ``Manifest`` (msgpack)
summaries      sid                                         ``Summary`` (msgpack, small: what lookups read)
tokens         sid                                         the snapshot's tokens as little-endian int64
sessions       idk + nsk + session id (utf-8)              sid of the session's latest snapshot
prefix         16-byte boundary hash (dupsort)             continuation (128 bytes) + lineage id of every session
                                                           whose current snapshot holds that boundary
heads          lineage id (``keys.lineage_id``, 16 bytes)  sid of that session's current snapshot
chunks         16-byte chunk hash                           ``ChunkMeta`` (refcount, sizes, encoding, last use)
lru            idk + be64 last-used ns + sid               empty (eviction order per identity)
packs          pack object name (utf-8)                    ``PackMeta`` (live chunks / bytes, size, manifests)
quarantine     idk + nsk + session id                      sid hex + reason (msgpack)
bad_chunks     16-byte chunk hash                          [pack, offset, reason, ns] of the copy that failed
=============  ==========================================  ==============================================
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

import lmdb

from ...errors import CorruptData, IncompatibleFormat, KvShelfError, StoreBusy, StoreFull
from . import lmdb_check
from ..base import syncs
from .protocol import DUP_TABLES, PLAIN_TABLES, Batching, IndexTxn
from .legacy_view import LegacyView
from .lmdb_txn import LmdbTxn
from ..base.syncs import ensure_dir

INDEX_FORMAT = 3  # 2: layout v2 (packs, sealed records); 3: prefix records tagged by session lineage (records.py)
READS_FORMATS = (1, 2, 3)  # 1 and 2 are migrated at a writing open, in one write transaction (``Index._check_format``);
# a read-only handle reads them as they are (legacy_view.py)
_T = TypeVar("_T")


def _disk_nearly_full(path: str, reserve: int = 8 << 20) -> bool:
    """LMDB reports a failed page write as EIO; a filesystem with almost no room left says what it was."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < reserve


class _Shared:
    """One LMDB environment per directory and process (LMDB forbids opening it twice), shared by Store handles."""

    def __init__(self, path: str, map_size: int, read_only: bool = False):
        lmdb_check.check_data_file(path)  # a truncated data.mdb would SIGBUS once mapped
        # read-only (store/access.py): the map opens read-only; LMDB's reader slot needs a writable lock.mdb, and
        # without one the reader runs unregistered (lock=False; access.py says what that gives up)
        lock = not read_only or os.access(os.path.join(path, "lock.mdb"), os.W_OK)
        try:
            self.env = lmdb.open(path, map_size=map_size, max_dbs=16, subdir=True, lock=lock, sync=True,
                                 metasync=True, readahead=False, mode=0o600, max_readers=256, max_spare_txns=4,
                                 readonly=read_only, create=not read_only)
        except lmdb.Error as exc:
            if lmdb_check.is_damage(exc):
                raise lmdb_check.translate(exc, path) from exc
            raise KvShelfError(f"could not open the index at {path}: {type(exc).__name__}: {exc}") from exc
        try:
            self.db = {name: db for name in (*PLAIN_TABLES, *DUP_TABLES)
                       if (db := self._open_db(name, name in DUP_TABLES, read_only)) is not None}
        except lmdb.Error as exc:
            self.env.close()
            raise (lmdb_check.translate(exc, path) if lmdb_check.is_damage(exc) else
                   KvShelfError(f"could not open the index at {path}: {type(exc).__name__}: {exc}")) from exc
        self.missing = tuple(name for name in (*PLAIN_TABLES, *DUP_TABLES) if name not in self.db)
        self.legacy = None  # a read-only handle's in-memory tables (legacy_view.py), made by the first Index
        self.lock = threading.RLock()
        self.users = 0

    def _open_db(self, name: str, dup: bool, read_only: bool):
        """A table's handle; a writing open creates a table the file lacks (one added since it was written), a
        read-only one cannot: None, and the table reads as empty (legacy_view.py)."""
        try:
            return self.env.open_db(name.encode(), dupsort=dup, create=not read_only)
        except lmdb.NotFoundError:
            if read_only:
                return None
            raise


_OPEN: dict[str, _Shared] = {}
_OPEN_LOCK = threading.Lock()


class Index(Batching):
    """The LMDB implementation of ``protocol.IndexStore``: one environment with the store's tables; transactions
    are ``lmdb_txn.LmdbTxn``; ``write(fn)`` retries after growing a full map."""

    supports_page_stats = True  # pages on this disk: a delete's commit may need fresh ones (space/reserve.py)
    lmdb_directory = True  # copy_to / reopen / map_size / users (the offline tools' index swap)

    def __init__(self, path: str, map_size: int = 64 << 30, retag_prefix_records=None, access=None):
        """``retag_prefix_records(txn)``: what re-tags the prefix records of an index older than format 3 (the
        prefix room owns those records, and the index imports no room above it: the store passes it in).
        ``access``: a read-only handle's (store/access.py): nothing is created, ``write`` refuses."""
        self._retag = retag_prefix_records
        self.access = access
        read_only = access is not None and access.read_only
        if not read_only:
            ensure_dir(path)
        self.path = os.path.realpath(path)
        self.pid = os.getpid()
        with _OPEN_LOCK:
            shared = _OPEN.get(self.path)
            if shared is not None and shared.pid == self.pid and shared.read_only and not read_only:
                raise StoreBusy(f"the index at {self.path} is open read-only in this process; close those handles "
                                f"before opening it for writing")
            if shared is None or shared.pid != self.pid:
                shared = _Shared(self.path, map_size, read_only)
                shared.read_only = read_only
                shared.pid = self.pid
                _OPEN[self.path] = shared
            shared.users += 1
        self._shared = shared
        self.env, self.db, self._lock = shared.env, shared.db, shared.lock
        self._closed = False
        self.legacy: LegacyView | None = None  # a read-only handle's in-memory tables (legacy_view.py)
        try:
            self._check_format()
        except BaseException:
            self.close()
            raise
        self.legacy = shared.legacy

    def _format(self, raw) -> int | None:
        if raw is None:
            return None
        if len(raw) != 8:
            raise CorruptData(f"the index at {self.path}: its format record is {len(raw)} bytes, not 8 (damaged)")
        return struct.unpack("<Q", raw)[0]

    def _check_format(self) -> None:
        with self.read() as txn:
            raw = txn.get("meta", b"format")
        if self._format(raw) == INDEX_FORMAT and not self._shared.missing:
            return  # the common case: no write transaction (no fsync) at open
        if self._read_only:
            self._read_as_it_is(self._format(raw))
            return
        def mark(txn):  # re-read inside the write transaction: of two processes opening together, one migrates
            raw = txn.get("meta", b"format")
            found = self._format(raw)
            if found is None or found in READS_FORMATS:
                if found != INDEX_FORMAT:
                    txn.put("meta", b"format", struct.pack("<Q", INDEX_FORMAT))
                    if found is None or found < 2:  # v1 leases: gone with commits
                        txn.raw.drop(self.env.open_db(b"leases", txn=txn.raw), delete=True)
                    if self._retag is not None:  # formats 1, 2: prefix records tagged by snapshot, re-tagged
                        self._retag(txn)
            else:
                raise IncompatibleFormat(f"index at {self.path} has format {found}, "
                                         f"this kvshelf reads format {INDEX_FORMAT}")

        self.write(mark)

    def _read_as_it_is(self, found: int | None) -> None:
        """A read-only handle never upgrades (the owner's next open does): an older format, or a file lacking a
        table added since, is read as it is through in-memory tables (legacy_view.py); a newer one is refused."""
        if found is not None and found not in READS_FORMATS:
            raise IncompatibleFormat(f"index at {self.path} has format {found}, this kvshelf reads format "
                                     f"{INDEX_FORMAT}")
        shared = self._shared
        with self._lock:
            if shared.legacy is None:
                derive = self._retag if found != INDEX_FORMAT else None
                with self.env.begin(buffers=False) as raw:
                    shared.legacy = LegacyView(LmdbTxn(raw, self.db), shared.missing, derive)

    @property
    def _read_only(self) -> bool:
        return self.access is not None and self.access.read_only

    def _check_pid(self) -> None:
        if os.getpid() != self.pid:
            raise KvShelfError("a Store cannot be used across fork(); open it again in the child process")

    def read(self) -> "_Read":
        """A read transaction as a context manager (``with index.read() as txn``): a map another process grew is
        adopted first, and LMDB's damaged-record errors leave the block as ``CorruptData``."""
        self._check_pid()
        try:
            try:
                txn = self.env.begin(buffers=False)
            except lmdb.MapResizedError:  # another process grew the map past ours: adopt its size, begin again
                self._adopt_map_size()
                txn = self.env.begin(buffers=False)
        except lmdb.Error as exc:
            raise self._error(exc) from exc
        return _Read(txn, self)

    def _adopt_map_size(self) -> None:
        with self._lock:
            self.env.set_mapsize(0)

    def translate_error(self, exc: BaseException) -> KvShelfError | None:
        """An ``lmdb.Error`` raised while a caller consumed a streamed batch, as the ``KvShelfError`` it means."""
        return self._error(exc) if isinstance(exc, lmdb.Error) else None

    def _error(self, exc: lmdb.Error) -> KvShelfError:
        if lmdb_check.is_damage(exc):
            return lmdb_check.translate(exc, self.path)
        if isinstance(exc, lmdb.ReadersFullError):
            return StoreBusy(f"the index at {self.path} has no free reader slot ({exc})")
        return KvShelfError(f"the index at {self.path} failed: {type(exc).__name__}: {exc}")

    def write(self, fn: Callable[[lmdb.Transaction], _T]) -> _T:
        """Run ``fn`` in one write transaction; a full map is grown (doubled) and ``fn`` re-run from scratch.
        ``StoreReadOnly`` on a read-only handle (before anything starts)."""
        if self.access is not None:
            self.access.check("a write transaction of the index")
        self._check_pid()
        with self._lock:
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        result = fn(LmdbTxn(txn, self.db))
                    syncs.note_commit()
                    return result
                except lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
                except lmdb.MapResizedError:  # another process grew the map: adopt its size and run fn again
                    self.env.set_mapsize(0)
                except lmdb.Error as exc:
                    if _disk_nearly_full(self.path) or "No space" in str(exc):
                        raise StoreFull(f"the index at {self.path} could not commit: the disk is full ({exc}); "
                                        f"the transaction was rolled back and nothing was committed") from exc
                    raise self._error(exc) from exc

    @property
    def users(self) -> int:
        """Open ``Index`` objects of this process on this environment (Store handles share one)."""
        return self._shared.users

    def writer_lock(self) -> threading.RLock:
        """The process-wide lock every write transaction of this environment runs under (a context manager)."""
        return self._lock

    def page_stats(self) -> tuple[int, dict[str, dict]]:
        """LMDB's page size and every table's page statistics (``reserve.needed_bytes`` sizes a full disk's
        reserve from them): a read transaction, no data read."""
        with self.env.begin() as txn:
            return self.env.stat()["psize"], {name: txn.stat(db) for name, db in self.db.items()}

    def map_size(self) -> int:
        return self.env.info()["map_size"]

    def reopen(self, map_size: int) -> "Index":
        """A fresh handle on this directory (after the tools replaced it while this one was closed)."""
        return Index(self.path, map_size=map_size, retag_prefix_records=self._retag, access=self.access)

    def copy_to(self, target: str) -> None:
        """A compacting copy of the environment into directory ``target`` (``rebuild`` / ``compact`` swap it in);
        a full disk is ``StoreFull`` and leaves the index unchanged."""
        try:
            self.env.copy(target, compact=True)
        except lmdb.Error as exc:  # a full disk is lmdb.DiskError (ENOSPC): say so, as every other write does
            if "No space" in str(exc) or isinstance(exc, lmdb.DiskError):
                raise StoreFull(f"copying the index into {target} failed: the disk is full ({exc}); the store is "
                                f"unchanged") from exc
            raise KvShelfError(f"copying the index into {target} failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _OPEN_LOCK:
            self._shared.users -= 1
            if self._shared.users == 0:
                if _OPEN.get(self.path) is self._shared:
                    del _OPEN[self.path]
                self.env.close()


class _Read:
    """``with index.read() as txn``: the transaction is aborted on leaving; a damaged-record LMDB error raised in
    the block becomes ``CorruptData`` (a MapResized met mid-block is a ``KvShelfError``: the caller's read retries)."""

    __slots__ = ("txn", "index")

    def __init__(self, txn: lmdb.Transaction, index: Index):
        self.txn, self.index = txn, index

    def __enter__(self) -> IndexTxn:
        txn = LmdbTxn(self.txn, self.index.db)
        legacy = self.index.legacy
        return txn if legacy is None else legacy.over(txn)

    def __exit__(self, typ, exc, tb) -> None:
        self.txn.abort()
        if exc is not None and isinstance(exc, lmdb.Error):
            raise self.index._error(exc) from exc


__all__ = ["Index", "INDEX_FORMAT"]
