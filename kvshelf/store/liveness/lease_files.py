"""Readers' leases without a synced commit: one lease file per store handle, alive while its flock is held.

Why: v1 wrote every lease as a synced LMDB commit, so every restore paid an fsync, and judged a lease alive by its
PID (wrong across PID namespaces and after PID reuse). Here a handle publishes its live leases by rewriting its own
file ``<root>/leases/<uuid>.lease`` (``pwrite``, no fsync: leases need not survive a crash — a dead process holds
nothing), and holds an exclusive ``flock`` on it for its whole life. The kernel drops that lock when the process dies,
however it dies, so anyone can tell live lease files from residue: a file it can lock is dead (and is reaped).

Safety argument (the one v1's commit gave): a reader publishes its lease *before* it checks, in a fresh LMDB read
transaction, that every chunk it will read is still referenced. An unlinker removes an object only in a write
transaction that starts after the drop committed, and reads the lease files inside it. If the reader's check saw the
chunks referenced, its publication happened before the drop's commit, so the unlinker sees it; otherwise the reader
gives up (``SnapshotNotFound``/stale) and never reads.

File format: ``u64 length | u64 xxh3-64 | msgpack [Lease, ...]``; a reader racing a rewrite sees a bad checksum and
reads again; one it cannot parse after retries is treated as holding everything (nothing is unlinked this round).

A full disk: the file's room (``LEASE_ROOM``) is allocated when it is made, and a body that outgrows it is allocated
(``posix_fallocate``) *before* it is written, so a publication either fits in allocated blocks or writes nothing —
the file never holds a torn body that would read as "leasing everything" and stop deletes from freeing space. When
it writes nothing, ``add`` keeps the lease in memory (this handle's own unlinkers see it) and returns False: the
reader then protects its read with object locks instead (``liveness/object_locks.py``), which need no space at all.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
import uuid

import msgspec
import xxhash

from ...errors import file_error
from ..base.syncs import ensure_dir
from ..index.schema import Lease

_HEAD = struct.Struct("<QQ")
LEASE_ROOM = 64 << 10  # bytes allocated for each handle's lease file when it is made
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(list[Lease])


class Unknown(Exception):
    """A lease file that could not be read consistently: treat it as leasing everything."""


class LeaseBook:
    """This handle's leases (published in its lease file) and a view of every live handle's leases."""

    def __init__(self, root: str, access=None):
        self.dir = os.path.join(root, "leases")
        # a read-only handle (store/access.py) publishes nothing: ``add`` answers False, so its reads are protected
        # by reader locks on the objects (object_locks.py, read-only descriptors), and ``reap`` only counts
        self.read_only = access is not None and access.read_only
        if not self.read_only:
            ensure_dir(self.dir)
        self._held: dict[bytes, Lease] = {}
        self._lock = threading.Lock()
        self._fd = -1
        self._name = ""
        self._room = 0  # bytes of the lease file known to be allocated (publishing within them needs no space)
        self._pid = os.getpid()

    def _open_own(self) -> None:
        stem = uuid.uuid4().hex
        tmp = os.path.join(self.dir, f"{stem}.new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for the handle's life; the kernel drops it when the process dies
        self._name = f"{stem}.lease"
        try:  # room allocated up front: publishing a few leases never needs a block on a full disk
            os.posix_fallocate(fd, 0, LEASE_ROOM)
            self._room = LEASE_ROOM
        except OSError:
            self._room = 0
        os.rename(tmp, os.path.join(self.dir, self._name))  # visible to checkers only once locked
        self._fd = fd

    def _publish(self) -> None:
        """Header + body at offset 0 (readers check the header's length and checksum, so bytes past the body are
        ignored): the file keeps its allocated room instead of shrinking to each body. Space is allocated before the
        write, so an ENOSPC leaves the previous publication intact (over-protective at worst, never torn)."""
        body = _ENC.encode(list(self._held.values()))
        data = _HEAD.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body
        if self._fd < 0:
            self._open_own()
        if len(data) > self._room:
            os.posix_fallocate(self._fd, 0, len(data))
            self._room = len(data)
        if os.pwrite(self._fd, data, 0) != len(data):  # pragma: no cover - allocated blocks take a whole write
            raise OSError(errno.ENOSPC, "short write publishing leases", self._name)
        size = os.fstat(self._fd).st_size
        if size > max(LEASE_ROOM, 2 * len(data)):
            os.ftruncate(self._fd, max(LEASE_ROOM, len(data)))
            self._room = min(self._room, max(LEASE_ROOM, len(data)))

    def add(self, key: bytes, lease: Lease) -> bool:
        """Hold ``lease`` and publish it. False when the disk had no room to publish it: the lease is held in memory
        only (seen by this handle, not by other handles), and the caller must protect its read another way
        (``liveness/object_locks.py``) or drop it with ``remove``."""
        with self._lock:
            self._held[key] = lease
            if self.read_only:
                return False
            try:
                self._publish()
                return True
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    return False
                self._held.pop(key, None)  # not held: the read must not go on
                raise file_error(exc, f"publishing a lease in {self.dir}") from exc

    def remove(self, key: bytes) -> Lease | None:
        with self._lock:
            lease = self._held.pop(key, None)
            if lease is not None and self._fd >= 0:
                try:
                    self._publish()
                except OSError:  # the file still lists it: over-protective (its chunks kept longer), never unsafe
                    pass
            return lease

    def live(self, now: float | None = None) -> list[Lease]:
        """Every unexpired lease of every live handle (this one's from memory). Raises ``Unknown`` when a live
        handle's file cannot be read consistently."""
        now = time.time() if now is None else now
        with self._lock:
            out = [lease for lease in self._held.values() if lease.expires > now]
        for name in self._files():
            if name == self._name:
                continue
            leases = self._read_live(os.path.join(self.dir, name))
            if leases:
                out.extend(lease for lease in leases if lease.expires > now)
        return out

    def _files(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.dir) if n.endswith(".lease")]
        except FileNotFoundError:
            return []

    def _read_live(self, path: str) -> list[Lease] | None:
        """The leases in another handle's file, or None when nobody holds it (dead: residue)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return None  # we could lock it: its owner is gone
            except BlockingIOError:
                pass
            for _attempt in range(50):
                raw = os.pread(fd, 1 << 24, 0)
                if len(raw) >= _HEAD.size and not any(raw[:_HEAD.size]):
                    return []  # locked, its room allocated, nothing published yet
                if len(raw) >= _HEAD.size:
                    n, digest = _HEAD.unpack_from(raw)
                    body = raw[_HEAD.size:_HEAD.size + n]
                    if len(body) == n and xxhash.xxh3_64_intdigest(body) == digest:
                        try:
                            return _DEC.decode(body)
                        except (msgspec.DecodeError, msgspec.ValidationError):
                            pass
                elif not raw:
                    return []  # locked, nothing published yet
                time.sleep(0.0005)
            raise Unknown(path)
        finally:
            os.close(fd)

    def reap(self, dry_run: bool = False) -> int:
        """Remove lease files nobody holds (their processes died); returns how many."""
        dead = 0
        for name in self._files():
            if name == self._name:
                continue
            path = os.path.join(self.dir, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            dead += 1
            if not dry_run and not self.read_only:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            os.close(fd)
        return dead

    def expired(self, now: float | None = None) -> list[bytes]:
        now = time.time() if now is None else now
        with self._lock:
            return [k for k, lease in self._held.items() if lease.expires <= now]

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            if self._fd >= 0 and os.getpid() == self._pid:
                try:
                    os.unlink(os.path.join(self.dir, self._name))
                except FileNotFoundError:
                    pass
                os.close(self._fd)
            self._fd = -1


__all__ = ["LeaseBook", "Unknown"]
