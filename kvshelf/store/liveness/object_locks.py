"""Readers' object locks: the lease that needs no disk space, for a restore on a full disk.

Why: a reader's lease is published by writing its handle's lease file (``leases.py``). That file has room allocated
when it is made, but a handle whose file was made on a full disk (or whose leases outgrow the room) cannot write a
byte, and a restore must never fail for want of one. A read lock is kernel state, not data: taking one needs no
space. So when publishing fails with ENOSPC/EDQUOT the reader instead holds, for the lease's life,

* a shared lock on ``locks/readers`` (made empty when the store is opened: an empty file takes no block), which says
  "some reader is protected by object locks right now", and
* a shared lock on every object (pack or v1 chunk file file) it will read,

*then* runs the lease's usual re-check in a fresh LMDB read transaction. Every unlinker (gc's sweep, the reclaim
after a delete / eviction / rewrite) asks ``Reclaimer.leased_objects`` (``reclaim.py``) what it must keep; the set it gets back
(``LeasedObjects``) also answers "yes" for an object some reader holds a lock on. It probes objects only while
somebody holds ``locks/readers``, so the usual case costs one ``fcntl`` per listing, not one per object.

Safety is the lease argument (``leases.py``) with "publish" replaced by "lock": an unlinker removes only objects the
index already says are dead, and it asks the locks after that death committed. A reader that locked before the ask is
seen; one that locked after it re-checks the index after that too, sees its chunks gone and never reads.

Locks are open-file-description locks (Linux ``F_OFD_SETLK``): they conflict between two ``open`` calls of the same
file even inside one process, and go when the description is closed (not, as classic POSIX record locks, when any
descriptor of the file in the process is closed). Where the platform has none (macOS) ``flock`` is used, which has
the same per-description meaning on a local filesystem. Nobody ever takes an exclusive lock on an object: a probe
is ``F_OFD_GETLK`` (or a non-blocking ``flock`` tried and dropped at once), so a reader never waits for long.
Only a local byte store has files to lock; on any other a lease that cannot be published stays ``StoreFull``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Callable, Iterable

from ...errors import KvShelfError

SENTINEL = os.path.join("locks", "readers")
_OFD = hasattr(fcntl, "F_OFD_SETLK") and hasattr(fcntl, "F_OFD_GETLK")
_FLOCK = struct.Struct("hhqqixxxx")  # struct flock (64-bit Linux): l_type, l_whence, l_start, l_len, l_pid


def make_sentinel(root: str) -> None:
    """Create ``locks/readers`` if it is missing (empty: no data block, so this works on a full disk too)."""
    try:
        os.close(os.open(os.path.join(root, SENTINEL), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    except OSError:
        pass  # no sentinel: readers cannot fall back to locks (their lease stays StoreFull), unlinkers probe nothing


def _lock_shared(fd: int) -> None:
    if _OFD:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0))
    else:  # pragma: no cover - macOS
        fcntl.flock(fd, fcntl.LOCK_SH)


def _locked_by_reader(fd: int) -> bool:
    """Whether another open file description holds a shared lock on this file."""
    if _OFD:
        out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        return _FLOCK.unpack(out)[0] != fcntl.F_UNLCK
    try:  # pragma: no cover - macOS
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # pragma: no cover
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)  # pragma: no cover
    return False  # pragma: no cover


def file_locked(path: str) -> bool:
    """Whether some reader holds a lock on the file at ``path`` (a missing file is held by nobody)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        return _locked_by_reader(fd)
    finally:
        os.close(fd)


class ReadLocks:
    """The locks one lease holds: the sentinel's and each object's; ``close`` drops them all."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def take(self, path: str, missing_ok: bool = False) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            if missing_ok:  # already unlinked: the lease's re-check sees its chunks moved, or the read reports it
                return
            raise
        self.fds.append(fd)
        _lock_shared(fd)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


def lock_objects(root: str, paths: Iterable[str]) -> ReadLocks:
    """Hold the sentinel and every object at ``paths`` (shared). ``OSError`` (ENOENT for a store without its
    sentinel) when the sentinel cannot be had: then nothing is held."""
    locks = ReadLocks()
    try:
        locks.take(os.path.join(root, SENTINEL))
        for path in paths:
            locks.take(path, missing_ok=True)
    except BaseException:
        locks.close()
        raise
    return locks


def prober(root: str, path_of: Callable[[str], str] | None) -> Callable[[str], bool] | None:
    """A test "is this object held by a reader's lock?", or None when no reader is protected by locks right now
    (nobody holds the sentinel) or the byte store has no files (``path_of`` is None)."""
    if path_of is None or not file_locked(os.path.join(root, SENTINEL)):
        return None

    def held(name: str) -> bool:
        try:
            return file_locked(path_of(name))
        except OSError as exc:  # cannot tell: keep it (over-protective, never unsafe)
            return exc.errno not in (errno.ENOENT, errno.ENOTDIR)
        except (ValueError, KvShelfError):  # not a valid object name: nothing of ours to keep
            return False

    return held


class LeasedObjects(set):
    """Object names live leases hold (the set's members), and — through ``probe`` — any object a reader on a full
    disk holds a lock on. ``name in leased`` asks both; ``leased | other`` keeps the probe, so the unlinkers'
    existing ``in`` / ``|`` code respects object locks unchanged. Iterating yields only the published names."""

    def __init__(self, names: Iterable[str] = (), probe: Callable[[str], bool] | None = None):
        super().__init__(names)
        self.probe = probe

    def __contains__(self, name: object) -> bool:
        if set.__contains__(self, name):
            return True
        return self.probe is not None and isinstance(name, str) and bool(name) and self.probe(name)

    def __or__(self, other):
        return LeasedObjects(set.union(self, other), self.probe)

    __ror__ = __or__

    def copy(self) -> "LeasedObjects":
        return LeasedObjects(self, self.probe)


__all__ = ["LeasedObjects", "ReadLocks", "SENTINEL", "file_locked", "lock_objects", "make_sentinel", "prober"]
