"""The store-wide save gate (``locks/save.lock``, an flock): why an orphan sweep never takes a save's pack.

A save writes its pack before the one commit that references it, so between the two the pack looks exactly like
crash residue. Saves hold the gate shared from their first write to their commit; orphan sweeps (``gc``, verify's
residue confirmation) and offline jobs hold it exclusively. Every handle of every process takes the same file, so
the rule holds across processes; the lock goes with the open file description, released by the kernel when a
process dies.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ...errors import StoreBusy


class SaveGate:
    """The gate of one store directory (``path``: its lock file, created here). On a read-only handle
    (``access``, store/access.py) nothing is created and ``hold`` refuses: whatever holds the gate writes."""

    def __init__(self, path: str, root: str, access=None):
        self.path, self.root, self.access = path, root, access
        if access is None or not access.read_only:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))

    @contextmanager
    def hold(self, exclusive: bool = False, timeout: float = 30.0) -> Iterator[None]:
        """Hold the gate (shared, or ``exclusive``) for the block; ``StoreBusy`` when it cannot be had within
        ``timeout`` seconds; ``StoreReadOnly`` on a read-only handle."""
        if self.access is not None:
            self.access.check("a save or maintenance (the save gate)")
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreBusy(f"the save gate of {self.root} stayed busy for {timeout:g}s (a gc, "
                                        f"compaction or offline job holds it{'' if exclusive else ' exclusively'})")
                    time.sleep(0.005)
            yield
        finally:
            os.close(fd)  # closing the description releases the lock


__all__ = ["SaveGate"]
