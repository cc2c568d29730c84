"""The removers' lock: a change that frees objects holds it shared from before its commit until it has unlinked
them; ``verify`` takes it exclusively (briefly) before calling anything crash residue.

Why: between a delete's (or eviction's, or a lease release's) index commit and its unlink, the objects it freed are
on disk and dead in the index — exactly what crash residue looks like. Without a lock, verify could only guess ("look
again a little later"), and a remover descheduled for longer than the guess became a false finding. With it, verify
waits until every remover in flight, in any process, is done; what is still dead and present then has no remover:
residue. Saves unlink what they freed inside the save gate, which verify takes exclusively anyway.

``locks/removers.lock``, ``flock``: shared for removers (many at once, never blocking each other), exclusive for
verify's confirmation (a few milliseconds). Within a process the shared lock is counted (an ``flock`` belongs to an
open file description, so one description serves every thread of the process). Lock order: removers' lock before
the save gate (a delete on a full disk may run gc's sweep, which takes the gate), and verify takes them in the same
order, so the two never wait on each other in a cycle.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager



class RemoversLock:
    def __init__(self, path: str, access=None):
        self.path, self.access = path, access  # access: a read-only handle (store/access.py) creates nothing
        if access is None or not access.read_only:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self._mutex = threading.Lock()
        self._users = 0
        self._fd = -1

    @contextmanager
    def removing(self) -> Iterator[None]:
        """Held (shared) around a commit that frees objects and the unlink of what it freed."""
        if self.access is not None:
            self.access.check("removing objects")
        with self._mutex:
            if self._users == 0:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a verify confirms its residue
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._users += 1
        try:
            yield
        finally:
            with self._mutex:
                self._users -= 1
                if self._users == 0:
                    os.close(self._fd)  # closing the description releases the lock
                    self._fd = -1

    @contextmanager
    def quiescent(self, timeout: float = 10.0) -> Iterator[bool]:
        """Exclusive: no remover is between its commit and its unlink while the block runs (True), or the lock
        could not be had within ``timeout`` seconds (False: removers kept it busy). A read-only handle locks the file
        through a read-only descriptor (``flock`` needs no write access), or yields False where it does not exist."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if self.access is None or not self.access.read_only:
                raise
            yield False
            return
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        got = False
                        break
                    time.sleep(0.002)
            yield got
        finally:
            os.close(fd)


__all__ = ["RemoversLock"]
