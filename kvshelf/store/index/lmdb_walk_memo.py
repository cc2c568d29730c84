"""A side file remembering that ``data.mdb`` passed the page walk, so an unchanged file is not walked at every open.

Why: the walk (``lmdbpages``) is pure Python and costs about 1 ms per MiB of index (a 64 MiB index: ~100 ms),
paid at every open of a store by every process. A file nobody wrote since it was walked needs no second walk.
``index/data.mdb.walked`` holds, behind a magic and an xxh3-64 of itself, the key of the file as it was walked:
``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns, xxh3-64 of both meta pages)``. Any write through the file
system — LMDB's commits, another program's flip, a copy over it — moves ``ctime`` (which no program can set back)
and a commit also moves a meta page's txnid, so a matching key means nobody wrote the file since.

Timestamps tick coarsely (a few ms): a write in the same tick as the previous one leaves ``ctime`` unchanged. So a
record is only made when the tick has moved on since the file last changed: the side file is stamped with the
file system's "now" (``utime``) *before* ``data.mdb`` is stat-ed for the walk, and the walk is remembered only when
that stamp is later than the file's ``ctime`` (any later write then gets a later ``ctime``) and the key after the
walk equals the key before. A damaged, short or foreign side file is simply no record (the file is
walked). What this cannot see: bytes that change without a write through the file system (a failing disk, a write
to the block device); the walk at the next change of the file catches those that are still there.
"""

from __future__ import annotations

import os
import struct

import xxhash

NAME = "data.mdb.walked"
_MAGIC = b"KVSHWLK1"
_KEY = struct.Struct("<QQQqqQ")
ROOM = 8 << 20  # free bytes below which no record is written (nor its file created)


def key_of(fd: int, metas: tuple[bytes, bytes]) -> bytes:
    """The file's key: its identity, size and change times, and a hash of both meta pages' first bytes."""
    st = os.fstat(fd)
    return _KEY.pack(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                     xxhash.xxh3_64_intdigest(metas[0] + metas[1]))


def remembered(index_dir: str, key: bytes) -> bool:
    """True when the side file records exactly ``key`` (a walk of this very file passed)."""
    try:
        with open(os.path.join(index_dir, NAME), "rb") as f:
            raw = f.read(64)
    except OSError:
        return False
    body = raw[16:]
    return (len(raw) == 16 + _KEY.size and raw[:8] == _MAGIC and body == key
            and struct.unpack_from("<Q", raw, 8)[0] == xxhash.xxh3_64_intdigest(body))


class Pending:
    """A record in the making: ``Pending(index_dir)`` before the file is stat-ed (it stamps the side file with the
    file system's "now"), ``keep(before, after)`` after a walk that passed, ``close()`` in any case. Every failure
    to write (a read-only directory) and a disk with less than ``ROOM`` free only mean the next open walks again.
    Two processes recording at once each write a whole record of a walk that passed; a torn mix fails its
    checksum."""

    def __init__(self, index_dir: str) -> None:
        self.fd, self.tick = None, None
        try:
            st = os.statvfs(index_dir)
            if st.f_bavail * st.f_frsize < ROOM:
                return  # a nearly full disk: its last blocks are for leases and LMDB, not for a cache
            self.fd = os.open(os.path.join(index_dir, NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.utime(self.fd)
            self.tick = os.fstat(self.fd).st_mtime_ns
        except OSError:
            self.close()

    def keep(self, before: bytes, after: bytes) -> None:
        if self.fd is None or before != after or self.tick <= _KEY.unpack(before)[4]:
            return  # the file changed during the walk, or in the tick the walk began in
        record = _MAGIC + struct.pack("<Q", xxhash.xxh3_64_intdigest(before)) + before
        try:
            if os.pwrite(self.fd, record, 0) == len(record):
                os.ftruncate(self.fd, len(record))
        except OSError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


__all__ = ["NAME", "key_of", "remembered", "Pending"]
