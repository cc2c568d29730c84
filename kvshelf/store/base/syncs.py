"""Every fsync the store makes goes through here, counted per thread: the recording seam behind the tests and
benchmarks that assert a durable save costs at most three syncs and a restore none (the third is the LMDB commit,
counted by ``index.Index.write`` with ``note_commit``).

``counting()`` is a context manager yielding a dict that collects this thread's syncs while the block runs.
"""

from __future__ import annotations

import os

from .tally import ThreadTally

TOTALS = {"fsync": 0, "fsync_dir": 0, "index_commit": 0}
_TALLY = ThreadTally()
counting = _TALLY.counting


def _count(kind: str) -> None:
    TOTALS[kind] += 1
    _TALLY.count(kind)


def fsync(fd: int) -> None:
    _count("fsync")
    os.fsync(fd)


def fsync_dir(directory: str) -> None:
    """Make a rename or a new entry in ``directory`` durable."""
    _count("fsync_dir")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def note_commit() -> None:
    """One synced LMDB commit (LMDB fdatasyncs inside ``commit``)."""
    _count("index_commit")


def ensure_dir(path: str) -> None:
    """Create ``path`` (and parents) 0700, making the new entry durable in its parent."""
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent and parent != path:
            ensure_dir(parent)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return
        os.chmod(path, 0o700)
        fsync_dir(parent)


def total(sink: dict[str, int]) -> int:
    return sum(sink.values())


__all__ = ["counting", "ensure_dir", "fsync", "fsync_dir", "note_commit", "total", "TOTALS"]
