"""Shrinking the LMDB index: a compacting copy, swapped in atomically.

LMDB never returns freed pages to the file system; ``env.copy(path, compact=True)`` writes a copy without them.
Swapping that copy in is only safe when nobody else has the environment open: a process keeps writing to the inode it
mapped, so its later commits would land in the replaced file and be lost. Who has it open is the store's business
(``store.admin.exclusive``: every process with an open handle holds ``locks/open.lock`` shared, so converting it to
exclusive without blocking succeeds exactly when no other process has the store open, and openers wait meanwhile);
compaction does the copy and the swap inside that block, through ``Store.replace_index``. Never forced.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..codecs.snapshot_file import fsync_dir


def index_bytes(store_root: str | os.PathLike[str]) -> int:
    """Size of the store's LMDB file (0 before the index exists)."""
    try:
        return os.stat(Path(store_root) / "index" / "data.mdb").st_size
    except FileNotFoundError:
        return 0


def compact_copy(copy_index, work_dir: str | os.PathLike[str]) -> Path:
    """Write a compacted copy of the index (``copy_index(target_dir)``: ``Store.copy_index``) into a fresh
    directory under ``work_dir``; returns its data.mdb."""
    target = Path(work_dir) / f"index-compact-{os.getpid()}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(mode=0o700, parents=True)
    copy_index(str(target))
    data = target / "data.mdb"
    os.chmod(data, 0o600)
    with open(data, "rb") as fh:
        os.fsync(fh.fileno())
    return data


def swap_in(copy: Path, index_dir: str | os.PathLike[str]) -> None:
    """Atomically replace ``index_dir/data.mdb`` by ``copy`` (rename + directory fsync), then drop the work dir."""
    final = Path(index_dir) / "data.mdb"
    os.replace(copy, final)
    fsync_dir(index_dir)
    shutil.rmtree(copy.parent, ignore_errors=True)


def discard(copy: Path) -> None:
    """Drop a copy that will not be swapped in (and its work dir)."""
    shutil.rmtree(copy.parent, ignore_errors=True)


__all__ = ["index_bytes", "compact_copy", "swap_in", "discard"]
