"""``Access``: whether this process may write the store, decided once at open and declared on the ``StoreContext``.

Why one declared capability instead of catching ``PermissionError`` wherever a write happens: an open that writes
nothing must be *known* to write nothing (a store shared read-only, owned by another user, or on a read-only mount
must not be chmod-ed, locked for writing, reaped or sealed), and a call that would write must say so before it starts
(no half-made pack, no raw ``OSError``). So ``opening.open_context`` asks :func:`probe` once; every write path checks
``ctx.access.check(what)`` (the index's write transactions, the save gate, the removers' lock, the reserve, the
remembered uses, the lease files) and every open-time write is skipped when ``read_only``.

What a read-only handle gives up, and why that is safe:
- it publishes no lease files: a writer that may unlink under it is the store's owner, whose ``gc`` cannot see this
  reader; a pack unlinked after the index named it makes the read fail with ``FileMissing`` (never wrong bytes:
  every chunk is hash-checked), and on a read-only mount nothing can unlink at all;
- LMDB registers no reader slot when its lock file cannot be written (``lock=False``): a writer running meanwhile
  may reuse pages an old read transaction still walks; kvshelf keeps its read transactions short and checks every
  record it decodes, so such a race fails a read (``CorruptData`` / ``SnapshotNotFound``), it never restores wrong
  bytes. Where the lock file *is* writable (a group-writable ``index/``), the reader takes its slot as usual.
- no quarantine, no remembered uses (LRU order), no v1 sealing, no reaping: those are the owner's next open's.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from ...errors import StoreReadOnly

# what an open, a save or maintenance writes in a store directory: all must be writable for a writing handle
_WRITTEN = ("", "index", "index/data.mdb", "index/lock.mdb", "locks", "locks/save.lock", "locks/open.lock",
            "locks/removers.lock", "packs", "leases", "tmp")


@dataclass(frozen=True)
class Access:
    """``read_only``: the reason the store cannot be written (``None``: writable); ``path``: the first path found
    unwritable; ``errno``: ``EROFS`` (a read-only file system) or ``EACCES`` (permission)."""

    root: str
    reason: str | None = None
    path: str | None = None
    errno: int = 0

    @property
    def read_only(self) -> bool:
        return self.reason is not None

    def check(self, what: str) -> None:
        """Raise ``StoreReadOnly`` naming the call, the path and the missing permission when read-only."""
        if self.reason is not None:
            raise StoreReadOnly(self.errno, f"{what} needs to write the store at {self.root}, which this process "
                                f"opened read-only: {self.reason}", self.path)


def probe(root: str) -> Access:
    """How this process may use the existing store at ``root`` (no file is created, opened for writing or changed)."""
    try:
        on_ro_mount = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError:
        on_ro_mount = False
    if on_ro_mount:
        return Access(root, f"{root} is on a read-only file system", root, errno.EROFS)
    for rel in _WRITTEN:
        path = os.path.join(root, rel) if rel else root
        if os.path.lexists(path) and not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
            return Access(root, f"no write permission on {path} for uid {os.geteuid()}", path, errno.EACCES)
    return Access(root)


__all__ = ["Access", "probe"]
