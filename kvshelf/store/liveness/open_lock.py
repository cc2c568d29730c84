"""Who has a store open: every process with an open handle holds ``<root>/locks/open.lock`` shared (``flock``).

One lock per process and store directory (handles of one process share it, counted), taken before the LMDB
environment is opened and dropped after the last handle closes it. An offline job that must be the store's only user
(the LMDB compacting swap, ``rebuild_index``) converts it to exclusive without blocking: that succeeds exactly when
no other process has the store open, and openers meanwhile wait (up to ``OPEN_TIMEOUT``) instead of mapping a file
about to be replaced. Linux drops a shared ``flock`` whose conversion fails, so the lock is taken shared again at
once; exclusive takers are serialized by the store's save gate (held exclusively around the attempt), so no other
process can slip in between.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ...errors import StoreBusy
from ..index import keys

OPEN_TIMEOUT = 30.0


class _Held:
    def __init__(self, fd: int):
        self.fd, self.users, self.pid, self.exclusive = fd, 0, os.getpid(), False


_HELD: dict[str, _Held] = {}
_LOCK = threading.Lock()


def acquire(root: str, timeout: float | None = None, read_only: bool = False) -> None:
    """Count one more open handle of this process on ``root`` (taking the shared lock for the first, waiting up to
    ``timeout`` seconds, default ``OPEN_TIMEOUT``, while an offline job holds it exclusively). ``read_only``: a
    store this process cannot write — the lock file is opened read-only (``flock`` needs no write access) and not
    created; where it does not exist there is no offline job to wait for (only a writer makes it)."""
    timeout = OPEN_TIMEOUT if timeout is None else timeout
    with _LOCK:
        held = _HELD.get(root)
        if held is not None and held.pid == os.getpid():
            held.users += 1
            return
        try:
            fd = os.open(keys.open_lock_path(root), (os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT) | os.O_CLOEXEC,
                         0o600)
        except FileNotFoundError:
            if not read_only:
                raise
            held = _HELD[root] = _Held(-1)
            held.users = 1
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise StoreBusy(f"the store at {root} has been held exclusively by an offline job (index "
                                    f"compaction or rebuild) for more than {timeout:.0f}s; try again") from None
                time.sleep(0.01)
        held = _HELD[root] = _Held(fd)
        held.users = 1


def release(root: str) -> None:
    """One handle of this process closed; the last one drops the lock."""
    with _LOCK:
        held = _HELD.get(root)
        if held is None or held.pid != os.getpid():
            return
        held.users -= 1
        if held.users == 0:
            del _HELD[root]
            if held.fd >= 0:
                os.close(held.fd)


def users(root: str) -> int:
    """Open handles of this process on ``root``."""
    with _LOCK:
        held = _HELD.get(root)
        return 0 if held is None or held.pid != os.getpid() else held.users


@contextmanager
def exclusive(root: str) -> Iterator[None]:
    """Hold the lock exclusively (this process must hold it shared). Raises ``StoreBusy`` when another process has
    the store open. The caller must hold the store's save gate exclusively (it serializes exclusive takers)."""
    with _LOCK:
        held = _HELD.get(root)
        if held is None or held.pid != os.getpid():
            raise StoreBusy(f"this process does not have the store at {root} open")
        try:
            fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(held.fd, fcntl.LOCK_SH)  # the failed conversion dropped our shared lock: take it back
            raise StoreBusy(f"another process has the store at {root} open") from None
        held.exclusive = True
    try:
        yield
    finally:
        with _LOCK:
            held.exclusive = False
            fcntl.flock(held.fd, fcntl.LOCK_SH)


def is_exclusive(root: str) -> bool:
    """Whether this process holds ``root`` exclusively right now (inside ``exclusive``)."""
    with _LOCK:
        held = _HELD.get(root)
        return held is not None and held.pid == os.getpid() and held.exclusive


__all__ = ["StoreBusy", "acquire", "release", "users", "exclusive", "is_exclusive", "OPEN_TIMEOUT"]
