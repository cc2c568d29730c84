"""A little disk space held back so a full disk can still be emptied.

LMDB is copy-on-write: deleting a session on a full filesystem needs fresh pages, so ``delete`` (the one thing that
would make room) failed with ``StoreFull`` exactly when it was needed. Each store keeps ``locks/reserve``, a
``RESERVE_BYTES`` file allocated with ``posix_fallocate``; a delete, quarantine or gc that meets ``StoreFull``
truncates it and retries once, and ``gc`` (which frees space) puts it back. Best effort everywhere: a filesystem
without room for the reserve simply has none.
"""

from __future__ import annotations

import os

RESERVE_BYTES = 512 << 10


def path_of(root: str) -> str:
    return os.path.join(root, "locks", "reserve")


def ensure(root: str) -> bool:
    """Allocate the reserve if it is missing or short; False when the filesystem has no room for it."""
    path = path_of(root)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size >= RESERVE_BYTES:
            return True
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
        return True
    except OSError:
        try:
            os.ftruncate(fd, 0)  # a half-allocated reserve would only hide the shortage
        except OSError:
            pass
        return False
    finally:
        os.close(fd)


def release(root: str) -> bool:
    """Give the reserve back to the filesystem; True when there was one to give."""
    path = path_of(root)
    try:
        if os.path.getsize(path) == 0:
            return False
        os.truncate(path, 0)
        return True
    except OSError:
        return False


__all__ = ["RESERVE_BYTES", "ensure", "release", "path_of"]
