"""``LocalByteStore``: the ByteStore seam over a local directory (packs, legacy v1 chunk files, tombstones).

Why this shape: a durable save must cost one data pass and exactly two syncs here (the file, then its directory).
``put`` writes a tmp file held under ``flock`` from its creation (so a reaper tells a live writer from crash residue
by the kernel-released lock, never by a PID, across PID namespaces too) with ``pwritev`` straight from the caller's
buffers (no join, no copy), then ``fsync``, renames it over ``name`` and fsyncs the directory; a streamed put starts
the writeback of every 4 MiB it has written (``start_writeback``), so its ``fsync`` waits only for the tail. ``put(..., durable=False)`` skips both syncs (tombstones, evidence: losing
one in a power cut is harmless). Reads are ``preadv`` into the caller's memoryviews; ``open_reader`` keeps one file
descriptor for many ranged reads (the restore path's fast path).

Every write passes through :func:`kvshelf.store.seams._inject_faults` (the ENOSPC test seam) and every sync through
:mod:`kvshelf.store.syncs` (counted, so tests and benchmarks can assert how many a save or a restore makes).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import sys
import uuid
from collections.abc import Iterator, Sequence

from ...errors import CorruptData, StoreFull
from ..base import seams
from ..base import syncs
from ..base.syncs import ensure_dir
from .protocol import Buffer, ObjectMissing, capability, check_name

DIR_MODE, FILE_MODE = 0o700, 0o600
IO_MAX = 0x7FFFF000  # write(2)/read(2) move at most this many bytes per call
IOV_MAX = 1024


WRITEBACK_BYTES = 4 << 20  # written bytes after which a streamed put starts their writeback (start_writeback)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the device now, without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: no flush, no durability — the pack's ``fsync`` stays the barrier).

    Why: a durable save's bytes then reach the disk while later chunks are still being hashed and written, so the
    final ``fsync`` waits only for the tail. Measured here on 49.5 MiB in 16 parts: 35.7 -> 23.0 ms to durable; on
    512 MiB in 64 parts 359 -> 227 ms. A no-op where the call does not exist (macOS) or fails."""
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # a failure only loses the head start


def _write_started(fd: int, views: list[memoryview], at: int, durable: bool, kicked: int) -> int:
    """``pwrite_all`` of ``views`` from ``at``; when ``durable``, in groups of ``WRITEBACK_BYTES`` whose writeback
    is started as soon as they are written (a 200 MiB part reaches the disk while it is still being written).
    ``kicked``: where the writeback started so far ends; returns where it ends now."""
    if not durable:
        pwrite_all(fd, views, at)
        return kicked
    for group in _groups(views, WRITEBACK_BYTES):
        at += pwrite_all(fd, group, at)
        whole = at & ~(_PAGE - 1)  # never a partial page: the next write into it would wait for its writeback
        if whole - kicked >= WRITEBACK_BYTES:
            start_writeback(fd, kicked, whole - kicked)
            kicked = whole
    return kicked


def _groups(views: list[memoryview], nbytes: int) -> Iterator[list[memoryview]]:
    """``views`` in consecutive groups of about ``nbytes`` (a view longer than that is cut), in order."""
    group, size = [], 0
    for v in views:
        while v.nbytes:
            take = v[:nbytes - size]
            group.append(take)
            size += take.nbytes
            v = v[take.nbytes:]
            if size >= nbytes:
                yield group
                group, size = [], 0
    if group:
        yield group


def _views(buffers: Sequence[Buffer]) -> list[memoryview]:
    return [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]


def pwrite_all(fd: int, views: list[memoryview], offset: int = 0) -> int:
    """``pwritev`` every view in order from ``offset`` (batched under IOV_MAX / IO_MAX, short writes resumed)."""
    at, pos = 0, offset
    pending: list[memoryview] = []
    while at < len(views) or pending:
        if not pending:
            size = 0
            while at < len(views) and len(pending) < IOV_MAX and (not pending or size + views[at].nbytes <= IO_MAX):
                v = views[at]
                if v.nbytes > IO_MAX:
                    pending.extend(v[i:i + IO_MAX] for i in range(0, v.nbytes, IO_MAX))
                else:
                    pending.append(v)
                size += v.nbytes
                at += 1
        n = os.pwritev(fd, pending[:IOV_MAX], pos)
        pos += n
        while pending and n >= pending[0].nbytes:
            n -= pending.pop(0).nbytes
        if n:
            pending[0] = pending[0][n:]
    return pos - offset


def pread_all(fd: int, views: Sequence[memoryview], offset: int, where: str) -> None:
    """``preadv`` into every view in order from ``offset``; ``CorruptData`` when the object ends first."""
    pending = [v for v in views if v.nbytes]
    pos = offset
    while pending:
        batch, size = [], 0
        for v in pending[:IOV_MAX]:
            if batch and size + v.nbytes > IO_MAX:
                break
            batch.append(v if v.nbytes <= IO_MAX else v[:IO_MAX])
            size += batch[-1].nbytes
        n = os.preadv(fd, batch, pos)
        if n <= 0:
            raise CorruptData(f"object {where}: range ends past its end (read stopped at byte {pos})")
        pos += n
        while pending and n >= pending[0].nbytes:
            n -= pending.pop(0).nbytes
        if n:
            pending[0] = pending[0][n:]


class LocalReader:
    """One open object: ranged ``read_into`` without reopening (a restore reads many pieces of one pack)."""

    def __init__(self, fd: int, name: str):
        self.fd, self.name = fd, name

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        if offset < 0:
            raise CorruptData(f"object {self.name!r}: negative offset {offset}")
        pread_all(self.fd, buffers, offset, self.name)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def will_need(self, offset: int, length: int) -> None:
        """Ask the kernel to start reading ``[offset, offset + length)`` now (0: to the end), asynchronously.

        Why: a restore reads a pack's chunks on several threads through one descriptor, so the kernel's readahead
        sees two interleaved streams and falls back to small reads: a cold 256 MiB restore read at ~40% of a raw
        read of the same file. Naming the whole range up front lets the disk stream it while the threads copy.
        A hint only: where the call is missing or refused nothing changes but the speed."""
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_WILLNEED)
            elif sys.platform == "darwin":  # F_RDADVISE (44): struct radvisory {off_t ra_offset; int ra_count}
                size = length or max(0, self.size() - offset)
                for at in range(offset, offset + size, 1 << 30):
                    fcntl.fcntl(self.fd, 44, struct.pack("qi4x", at, min(1 << 30, offset + size - at)))
        except (OSError, ValueError, struct.error):
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "LocalReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalByteStore:
    """Objects are files under ``root`` named by their object name; in-flight writes live under ``tmp_dir``."""

    supports_streaming = True  # put_stream
    local_paths = True  # path(name)
    reaps_tmp = True  # reap_tmp(dry_run)
    opens_readers = True  # open_reader(name)

    def __init__(self, root: str, tmp_dir: str | None = None, *, create: bool = True):
        """``create=False``: a store this process may only read (store/access.py) — nothing is made, not even a
        ``tmp_dir`` the store lacks (an older store, or one copied without its empty directories)."""
        self.root = os.path.abspath(root)
        self.tmp_dir = os.path.abspath(tmp_dir or os.path.join(self.root, ".tmp"))
        if create:
            ensure_dir(self.root)
            ensure_dir(self.tmp_dir)

    def path(self, name: str) -> str:
        """The file holding object ``name`` (local stores only: tests and tools that flip bytes use it)."""
        return os.path.join(self.root, check_name(name))

    # ------------------------------------------------------------------ writing
    def put(self, name: str, buffers: Sequence[Buffer], *, durable: bool = True) -> int:
        views = _views(buffers)
        total = sum(v.nbytes for v in views)

        def write(fd: int, final: str, done: list[int]) -> None:
            seams._inject_faults(final, total)
            _write_started(fd, views, 0, durable, 0)
            done[0] = total

        return self._write_object(name, write, durable)

    def put_stream(self, name: str, parts, *, durable: bool = True) -> int:
        """``put`` of the concatenation of ``parts`` (an iterable of buffer sequences) where producing the next part
        overlaps writing the previous one (``pwritev`` on a helper thread releases the GIL): the save path hashes
        chunk k+1 while chunk k is written. All or nothing, like ``put``."""
        from concurrent.futures import ThreadPoolExecutor

        def write(fd: int, final: str, done: list[int]) -> None:
            kicked = [0]  # bytes whose writeback has been started

            def write_part(views: list[memoryview], at: int, end: int) -> None:
                kicked[0] = _write_started(fd, views, at, durable, kicked[0])

            with ThreadPoolExecutor(1, thread_name_prefix="kvshelf-write") as writer:
                pending = None
                try:
                    for part in parts:
                        views = _views(part)
                        n = sum(v.nbytes for v in views)
                        seams._inject_faults(final, n)
                        if pending is not None:
                            pending.result()
                        pending = writer.submit(write_part, views, done[0], done[0] + n)
                        done[0] += n
                finally:
                    if pending is not None:
                        pending.result()

        return self._write_object(name, write, durable)

    def _write_object(self, name: str, write, durable: bool) -> int:
        """The one all-or-nothing write path of both puts: ``write(fd, final, done)`` fills a flock-held tmp file
        (counting bytes in ``done[0]``), then fsync, rename, directory fsync; any failure leaves no object behind,
        and ENOSPC/EDQUOT become ``StoreFull``."""
        final = self.path(name)
        done = [0]
        try:
            ensure_dir(os.path.dirname(final))
            fd, tmp_name = self._open_tmp()
            try:
                write(fd, final, done)
                if durable:
                    syncs.fsync(fd)
                os.rename(tmp_name, final)
            except BaseException:
                _unlink(tmp_name)
                raise
            finally:
                os.close(fd)  # drops the flock
            if durable:
                try:
                    syncs.fsync_dir(os.path.dirname(final))
                except BaseException:
                    _unlink(final)  # all or nothing: a put that raises leaves no object behind
                    raise
            return done[0]
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"no space left on device writing {name!r} ({done[0]}+ bytes written) under "
                                f"{self.root}: nothing was committed") from exc
            raise

    def _open_tmp(self) -> tuple[int, str]:
        """A new tmp file, ``flock``-ed by this writer; ``reap_tmp`` takes only unlocked files. A reaper that got
        between create and lock has unlinked the name: seen by the inode check, and we start again."""
        while True:
            tmp = os.path.join(self.tmp_dir, f"{uuid.uuid4().hex}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                    return fd, tmp
            except FileNotFoundError:
                pass
            os.close(fd)

    def reap_tmp(self, dry_run: bool = False) -> list[str]:
        """Remove in-flight files nobody holds (crash residue): liveness is the writer's kernel-released flock."""
        removed = []
        try:
            names = sorted(os.listdir(self.tmp_dir))
        except FileNotFoundError:
            return removed
        for name in names:
            path = os.path.join(self.tmp_dir, name)
            if os.path.isdir(path):
                continue  # work directories of offline jobs (held under the store's exclusive lock)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except (FileNotFoundError, IsADirectoryError):
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer holds it
                removed.append(name)
                if not dry_run:
                    _unlink(path)
            finally:
                os.close(fd)
        return removed

    # ------------------------------------------------------------------ reading
    def open_reader(self, name: str) -> LocalReader:
        try:
            fd = os.open(self.path(name), os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissing(f"object {name!r} does not exist") from None
        return LocalReader(fd, name)

    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        with self.open_reader(name) as reader:
            reader.read_into(offset, [memoryview(b).cast("B") for b in buffers])

    def size(self, name: str) -> int | None:
        try:
            return os.stat(self.path(name)).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> None:
        _unlink(self.path(name))

    def names(self, prefix: str = "") -> Iterator[str]:
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = os.path.join(self.root, head) if head else self.root
        found = []
        for dirpath, dirnames, filenames in os.walk(start):
            if os.path.abspath(dirpath) == self.tmp_dir:
                dirnames[:] = []
                continue
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) != self.tmp_dir]
            rel = os.path.relpath(dirpath, self.root)
            for f in filenames:
                name = f if rel == "." else f"{rel}/{f}"
                if name.startswith(prefix):
                    found.append(name)
        return iter(found)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["LocalByteStore", "LocalReader", "pread_all", "pwrite_all"]
