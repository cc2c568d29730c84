"""Who holds the LMDB index open, and shrinking it by a compacting copy swapped in atomically.

LMDB never returns freed pages to the file system; ``env.copy(path, compact=True)`` writes a copy without them.
Swapping that copy in is only safe when no *other* process has the environment open: a process keeps writing to
the inode it mapped, so its later commits would land in the replaced file and be lost. The rule we apply:

* the holders of ``index/data.mdb`` are found from ``/proc/<pid>/maps`` (every process that opened the environment
  maps that file; we compare device and inode, not names);
* the swap happens only when no process but ours maps it, checked before the copy and again immediately before the
  rename, while this process holds the store's save gate exclusively (no save is between its blobs and its commit);
* otherwise the step is skipped and reported ("index in use by pids ..."), never forced.

Where ``/proc`` is unavailable the holders cannot be known and the step is skipped.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _maps_inode(pid_dir: str, dev: int, ino: int) -> bool:
    try:
        with open(os.path.join(pid_dir, "maps"), "rb") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) < 5 or parts[4] != str(ino).encode():
                    continue
                major, minor = (int(x, 16) for x in parts[3].split(b":"))
                if os.makedev(major, minor) == dev:
                    return True
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return False
    return False


def holders(index_dir: str | os.PathLike[str]) -> set[int] | None:
    """Pids that map ``index_dir/data.mdb`` (None when this platform cannot tell)."""
    data = Path(index_dir) / "data.mdb"
    if not os.path.isdir("/proc/self") or not os.path.exists("/proc/self/maps"):
        return None
    try:
        st = os.stat(data)
    except FileNotFoundError:
        return set()
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and _maps_inode(os.path.join("/proc", name), st.st_dev, st.st_ino):
            found.add(int(name))
    return found


def other_holders(index_dir: str | os.PathLike[str]) -> set[int]:
    """Pids other than ours holding the index (an unknowable answer counts as "someone")."""
    found = holders(index_dir)
    if found is None:
        return {-1}
    return found - {os.getpid()}


def compact_copy(env, index_dir: str | os.PathLike[str], work_dir: str | os.PathLike[str]) -> Path:
    """Write a compacted copy of ``env`` into a fresh directory under ``work_dir``; returns its data.mdb."""
    target = Path(work_dir) / f"index-compact-{os.getpid()}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(mode=0o700, parents=True)
    env.copy(str(target), compact=True)
    data = target / "data.mdb"
    os.chmod(data, 0o600)
    with open(data, "rb") as fh:
        os.fsync(fh.fileno())
    return data


def swap_in(copy: Path, index_dir: str | os.PathLike[str]) -> None:
    """Atomically replace ``index_dir/data.mdb`` by ``copy`` (rename + directory fsync), then drop the work dir."""
    final = Path(index_dir) / "data.mdb"
    os.replace(copy, final)
    fd = os.open(index_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(copy.parent, ignore_errors=True)


__all__ = ["holders", "other_holders", "compact_copy", "swap_in"]
