"""LMDB's own file, checked before it is mapped, and LMDB's errors in kvshelf's words.

LMDB maps ``data.mdb`` and trusts it: a live page past the end of the file makes the first read of it a SIGBUS,
and a damaged page (a node offset or size past the page, a bad flag, a branch of one key) kills the reading
process inside liblmdb — SIGBUS, SIGSEGV or an assertion's SIGABRT — before any Python runs. Damage LMDB does
notice surfaces as ``lmdb.CorruptedError`` / ``PageNotFoundError`` / ``InvalidError`` / ``BadValsizeError`` from any
call. ``check_data_file`` runs before ``lmdb.open``: it reads the two meta pages with plain ``pread`` (magic,
version, page size, last page number, transaction id), picks the newer one as LMDB does, and walks every live
page from it (``lmdbpages``), so a truncated or damaged index is ``CorruptData`` at open, never a dead process;
``walkmemo`` spares the walk when the file is unchanged since one passed. The check covers the file as it is at
open. ``translate`` turns the damaged-record family into ``CorruptData``.

A file may legitimately end before page ``mm_last_pg``: LMDB counts pages it allocated and freed again within one
transaction without ever writing them. Only live pages have to lie in the file (an older rule here, "the file
holds ``(last_pg + 1) * page_size`` bytes", refused such healthy files).

Meta page layout (64-bit LMDB 0.9, little-endian here): a 16-byte page header (``mp_pgno`` u64, pad u16, flags u16
with ``P_META = 0x08``, lower/upper u16), then ``MDB_meta``: magic u32 ``0xBEEFC0DE`` at 16, version u32 at 20,
address at 24, mapsize at 32, two ``MDB_db`` records of 48 bytes at 40 and 88 (the first one's leading u32 is the
page size), ``mm_last_pg`` u64 at 136, ``mm_txnid`` u64 at 144.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time

import lmdb

from ...errors import CorruptData, StoreBusy
from . import keys
from . import lmdb_pages, lmdb_walk_memo

MAGIC = 0xBEEFC0DE
P_META = 0x08
_META_END = 152
WALKS = 3  # walks of a file another process keeps committing to before it is left to LMDB
_REPAIR = ("`kvshelf rebuild-index STORE` sets the damaged index aside (index.damaged-<ns>) and rebuilds it from the "
           "packs while no process has the store open, or restore the index directory from a backup")
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.BadValsizeError,
           lmdb.PageFullError, lmdb.VersionMismatchError, lmdb.BadTxnError, lmdb.BadRslotError)


def _meta(raw: bytes) -> tuple[int, int, int] | None:
    """(page size, last page number, txnid) of a meta page's first bytes, or None when they are not one."""
    if len(raw) < _META_END:
        return None
    _pgno, _pad, flags = struct.unpack_from("<QHHH", raw, 0)[:3]
    magic, version = struct.unpack_from("<II", raw, 16)
    psize = struct.unpack_from("<I", raw, 40)[0]
    last_pg, txnid = struct.unpack_from("<QQ", raw, 136)
    if magic != MAGIC or version != 1 or not flags & P_META or not 512 <= psize <= 1 << 16 or psize & (psize - 1):
        return None
    return psize, last_pg, txnid


def _metas(fd: int) -> tuple[bytes, bytes]:
    """The raw first bytes of both meta pages (the second one's place read from the first's page size)."""
    first = os.pread(fd, _META_END, 0)
    meta = _meta(first)
    return first, (os.pread(fd, _META_END, meta[0]) if meta is not None else b"")


def check_data_file(index_dir: str) -> int:
    """``CorruptData`` unless ``index_dir/data.mdb`` is absent (a new index) or carries a valid meta page whose
    trees pass ``lmdbpages``' walk (every live page inside the file and well formed). Returns how many walks it
    made: 0 when ``walkmemo`` remembers this very file passing, 1 normally.

    The walk sees the file as it is at open: damage made later (by another program, or the disk) is met by LMDB
    itself. Another process may commit while the walk runs; a walk that fails while the meta pages moved under it
    is walked again (up to ``WALKS`` times), and a file that never holds still that long is left to LMDB — the
    process committing to it is reading those pages without trouble."""
    path = os.path.join(index_dir, "data.mdb")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    memo = None
    try:
        if os.fstat(fd).st_size == 0:
            return 0  # created but never initialised (a crash between create and first commit): LMDB formats it
        if lmdb_walk_memo.remembered(index_dir, lmdb_walk_memo.key_of(fd, _metas(fd))):
            return 0  # walked, and not written since
        memo = lmdb_walk_memo.Pending(index_dir)
        for walks in range(1, WALKS + 1):
            raw = _metas(fd)
            before = lmdb_walk_memo.key_of(fd, raw)
            try:
                _judge(fd, raw, path)
            except CorruptData:
                if _metas(fd) == raw:
                    raise  # the file held still: the damage is in it
                continue
            memo.keep(before, lmdb_walk_memo.key_of(fd, _metas(fd)))
            return walks
        return WALKS
    finally:
        if memo is not None:
            memo.close()
        os.close(fd)


def _judge(fd: int, raw: tuple[bytes, bytes], path: str) -> None:
    """``CorruptData`` when the meta pages ``raw`` (read from ``fd``) or the pages they lead to are damaged."""
    size = os.fstat(fd).st_size
    metas = [m for m in (_meta(raw[0]), _meta(raw[1])) if m is not None]
    if len(metas) == 2 and metas[0][0] != metas[1][0]:
        metas = metas[:1]
    if not metas:
        raise CorruptData(f"the index file {path} is not an LMDB file this kvshelf reads (no valid meta page; "
                          f"{size} bytes): {_REPAIR}")
    at = max(range(len(metas)), key=lambda i: metas[i][2])
    psize, last_pg, _txnid = metas[at]
    # the file may end before page last_pg (pages allocated and freed unwritten): only live pages must be in it
    walk = lmdb_pages.Walk(lambda pgno, count: os.pread(fd, count * psize, pgno * psize), psize, last_pg + 1,
                          size // psize)
    try:
        walk.run(lmdb_pages.Db(raw[at], 40), lmdb_pages.Db(raw[at], 88))
    except lmdb_pages.PageDamage as exc:
        raise CorruptData(f"the index file {path} is damaged: {exc}; {_REPAIR}") from None


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
    index = os.path.join(root, "index")
    if not os.path.isdir(index):
        return None
    fd = os.open(keys.open_lock_path(root), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
