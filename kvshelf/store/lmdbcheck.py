"""LMDB's own file, checked before it is mapped, and LMDB's errors in kvshelf's words.

LMDB maps ``data.mdb`` and trusts it: a file shorter than the pages its meta page claims makes the first read past
the end a SIGBUS that kills the process, and damaged pages surface as ``lmdb.CorruptedError`` /
``PageNotFoundError`` / ``InvalidError`` / ``BadValsizeError`` from any call. ``check_data_file`` reads the two meta
pages with plain ``pread`` (magic, version, page size, last page number, transaction id), picks the newer one as
LMDB does, and refuses a file shorter than ``(last_pgno + 1) * page_size`` as ``CorruptData`` — so a truncated index
is an error at open, never a dead process. ``translate`` turns the damaged-record family into ``CorruptData``.

Meta page layout (64-bit LMDB 0.9, little-endian here): a 16-byte page header (``mp_pgno`` u64, pad u16, flags u16
with ``P_META = 0x08``, lower/upper u16), then ``MDB_meta``: magic u32 ``0xBEEFC0DE`` at 16, version u32 at 20,
address at 24, mapsize at 32, two ``MDB_db`` records of 48 bytes at 40 and 88 (the first one's leading u32 is the
page size), ``mm_last_pg`` u64 at 136, ``mm_txnid`` u64 at 144.
"""

from __future__ import annotations

import os
import struct

import lmdb

from ..errors import CorruptData

MAGIC = 0xBEEFC0DE
P_META = 0x08
_META_END = 152
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.BadValsizeError,
           lmdb.PageFullError, lmdb.VersionMismatchError, lmdb.BadTxnError, lmdb.BadRslotError)


def _meta(fd: int, offset: int) -> tuple[int, int, int] | None:
    """(page size, last page number, txnid) of the meta page at ``offset``, or None when it is not one."""
    raw = os.pread(fd, _META_END, offset)
    if len(raw) < _META_END:
        return None
    _pgno, _pad, flags = struct.unpack_from("<QHH", raw, 0)
    magic, version = struct.unpack_from("<II", raw, 16)
    psize = struct.unpack_from("<I", raw, 40)[0]
    last_pg, txnid = struct.unpack_from("<QQ", raw, 136)
    if magic != MAGIC or version != 1 or not flags & P_META or psize < 512 or psize & (psize - 1):
        return None
    return psize, last_pg, txnid


def check_data_file(index_dir: str) -> None:
    """``CorruptData`` unless ``index_dir/data.mdb`` is absent (a new index) or carries a valid meta page whose
    pages all lie inside the file."""
    path = os.path.join(index_dir, "data.mdb")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return  # created but never initialised (a crash between create and first commit): LMDB formats it
        first = _meta(fd, 0)
        metas = [first] if first is not None else []
        if first is not None:
            second = _meta(fd, first[0])
            if second is not None and second[0] == first[0]:
                metas.append(second)
        if not metas:
            raise CorruptData(f"the index file {path} is not an LMDB file this kvshelf reads (no valid meta page; "
                              f"{size} bytes): restore it from a backup or run `kvshelf rebuild-index`")
        psize, last_pg, _txnid = max(metas, key=lambda m: m[2])
        if last_pg > (1 << 48) or size < (last_pg + 1) * psize:
            raise CorruptData(f"the index file {path} is truncated: {size} bytes, its meta page needs "
                              f"{(last_pg + 1) * psize} ({last_pg + 1} pages of {psize}); run `kvshelf rebuild-index`")
    finally:
        os.close(fd)


def is_damage(exc: BaseException) -> bool:
    return isinstance(exc, _DAMAGE)


def translate(exc: lmdb.Error, where: str) -> CorruptData:
    """The ``CorruptData`` a damaged-record LMDB error stands for (the original chained)."""
    err = CorruptData(f"the index at {where} is damaged ({type(exc).__name__}: {exc}); "
                      f"run `kvshelf verify` / `kvshelf rebuild-index`")
    err.__cause__ = exc
    return err


def set_aside(root: str) -> str | None:
    """Move a damaged index directory aside (``index.damaged-<ns>``) so ``rebuild_index`` can build a fresh one from
    the packs — only while no process has the store open (its ``locks/open.lock`` taken exclusively, without
    waiting: ``StoreBusy`` otherwise). Returns the new name, or None when there was no index. Nothing is deleted:
    the damaged file stays as evidence next to the rebuilt index."""
    import fcntl
    import time

    from ..errors import StoreBusy
    from .openlock import lock_path

    index = os.path.join(root, "index")
    if not os.path.isdir(index):
        return None
    fd = os.open(lock_path(root), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreBusy(f"another process has the store at {root} open; stop it before rebuilding") from None
        target = f"{index}.damaged-{time.time_ns()}"
        os.rename(index, target)
        return target
    finally:
        os.close(fd)


__all__ = ["check_data_file", "is_damage", "set_aside", "translate"]
