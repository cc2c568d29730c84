"""Disk space held back so a full disk can still be emptied: sized to what the index commit of a delete can need.

LMDB is copy-on-write: deleting a session on a full filesystem needs fresh pages, so ``delete`` (the one thing that
would make room) failed with ``StoreFull`` exactly when it was needed. Each store keeps ``locks/reserve``, a file
allocated with ``posix_fallocate``; a delete, quarantine or gc that meets ``StoreFull`` truncates it and retries
(``space/full_disk.py``), and the space freed afterwards is taken back (``ensure``) by the delete, ``gc`` and each handle's
open. Best effort everywhere: a filesystem without room for the reserve simply has none, and then the removal paths
first free what is certainly dead (``space/full_disk.py``).

Why a fixed 512 KiB was not enough: a delete rewrites every B-tree page it touches. Its prefix records (one per
16-token boundary) have random keys, so in a store of many long sessions nearly each lands on a page of its own.
Measured (``tests/store/test_store_fullness.py::test_reserve_covers_the_pages_a_delete_allocates``) on a compacted
index holding 10 sessions of 20 000 tokens: deleting one allocated 761 fresh 4 KiB pages (3.0 MiB; the bound below
says 3.7 MiB). ``needed_bytes`` bounds it per sub-database by ``min(all its pages, records a delete of the longest
snapshot touches x (depth + 1))``, plus the free-list pages recording what the commit frees and a little slack;
never under ``RESERVE_BYTES``, never over ``MAX_RESERVE_BYTES``. The size is remembered per store directory in this
process (``ensure(root)`` without a size, as ``gc`` calls it, keeps the last one), and several processes simply grow
the one file to the largest they want.
"""

from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager

from ..index.protocol import capability

RESERVE_BYTES = 512 << 10  # the floor
MAX_RESERVE_BYTES = 1 << 30  # the ceiling: an index that needs more is far beyond any test of this bound
_SLACK_PAGES = 16  # meta pages, the main database's leaf, the free database's own path

_targets: dict[str, int] = {}
_suspended: dict[str, int] = {}
_state = threading.Lock()


def path_of(root: str) -> str:
    return os.path.join(root, "locks", "reserve")


def needed_bytes(index, longest_tokens: int, block: int = 16) -> int:
    """Bytes the index commit of deleting a snapshot of ``longest_tokens`` tokens can allocate (see the module
    docstring), from the sub-databases' page counts and depths (a read transaction, no data read)."""
    if not capability(index, "supports_page_stats"):  # not pages on this disk (memory): a delete allocates none
        return RESERVE_BYTES
    psize, tables = index.page_stats()
    touched = min(block, longest_tokens) + longest_tokens // max(block, 1) + 64  # its boundaries; chunks alike
    records = {"prefix": touched, "chunks": touched, "packs": touched}
    pages = overflow = 0
    for name, st in tables.items():
        tree = st["branch_pages"] + st["leaf_pages"] + 1
        pages += min(tree, records.get(name, 4) * (st["depth"] + 1))
        overflow += st["overflow_pages"]
    own_overflow = math.ceil(longest_tokens * 16 / psize) + 2  # its tokens and manifest records, freed
    freed = pages + min(overflow, own_overflow)
    free_list = math.ceil(freed / (psize // 8 - 1)) + 4
    need = (pages + free_list + _SLACK_PAGES) * psize
    return max(RESERVE_BYTES, min(MAX_RESERVE_BYTES, need))


def ensure(root: str, nbytes: int | None = None) -> bool:
    """Grow the reserve to ``nbytes`` (default: the last size asked for this store in this process, else the floor)
    if it is short; False when the filesystem has no room for that (the reserve then keeps what it had)."""
    with _state:
        if nbytes is not None:
            _targets[root] = max(nbytes, RESERVE_BYTES)
        target = _targets.get(root, RESERVE_BYTES)
        if _suspended.get(root):
            return False  # space is being freed for a removal's retry: do not take it back yet
    path = path_of(root)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    had = 0
    try:
        had = os.fstat(fd).st_size
        if had >= target:
            return True
        os.posix_fallocate(fd, 0, target)
        return True
    except OSError:
        try:
            os.ftruncate(fd, had)  # a half-grown reserve would only hide the shortage; keep what was whole
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


def held(root: str) -> int:
    """Bytes the reserve holds now."""
    try:
        return os.path.getsize(path_of(root))
    except OSError:
        return 0


@contextmanager
def suspended(root: str):
    """While a removal frees space for its own retry, ``ensure`` (which ``gc`` calls) takes none of it back."""
    with _state:
        _suspended[root] = _suspended.get(root, 0) + 1
    try:
        yield
    finally:
        with _state:
            _suspended[root] -= 1
            if not _suspended[root]:
                del _suspended[root]


__all__ = ["MAX_RESERVE_BYTES", "RESERVE_BYTES", "ensure", "held", "needed_bytes", "path_of", "release", "suspended"]
