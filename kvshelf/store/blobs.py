"""Where blob bytes live. ``BlobStore`` is the seam; ``LocalBlobStore`` is a directory of immutable files.

Every blob write goes through :func:`durable_write` (tmp file, fsync, rename, fsync dir), the one place where ENOSPC
becomes ``StoreFull`` and where tests inject faults: set ``FAULT_HOOK`` (in-process) or the environment variable
``KVSHELF_FAULT_ENOSPC_AFTER`` (a byte count; useful in subprocesses) to make writes fail as a full disk would.
"""

from __future__ import annotations

import errno
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..codecs.snapshot_file import fsync_dir
from ..errors import CorruptData, StoreFull
from .blobfile import BlobReader, Piece, kvz_buffers, raw_buffers

DIR_MODE, FILE_MODE = 0o700, 0o600
EXTENSIONS = {"raw": ".safetensors", "zstd": ".kvz"}
_IOV_MAX = 512

# Test seam: called as FAULT_HOOK(path, nbytes) before each blob write; may raise OSError(ENOSPC, ...).
FAULT_HOOK: Callable[[str, int], None] | None = None
_written_by_process = 0


def _inject_faults(path: str, nbytes: int) -> None:
    global _written_by_process
    if FAULT_HOOK is not None:
        FAULT_HOOK(path, nbytes)
    limit = os.environ.get("KVSHELF_FAULT_ENOSPC_AFTER")
    if limit is not None and _written_by_process + nbytes > int(limit):
        raise OSError(errno.ENOSPC, "No space left on device (injected by KVSHELF_FAULT_ENOSPC_AFTER)", path)
    _written_by_process += nbytes


def ensure_dir(path: str) -> None:
    if not os.path.isdir(path):
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        os.chmod(path, DIR_MODE)
        fsync_dir(os.path.dirname(path))


def durable_write(final: str, tmp_dir: str, buffers: list) -> int:
    """Write ``buffers`` to ``final`` atomically and durably; returns the bytes written. ENOSPC -> ``StoreFull``."""
    return durable_write_many([(final, buffers)], tmp_dir)[0]


def durable_write_many(items: list[tuple[str, list]], tmp_dir: str) -> list[int]:
    """Write several files atomically and durably, batching the syncs: write every tmp file, fsync each, rename
    each, then fsync each parent directory once. Either every file is in place when this returns, or none is new."""
    tmps: list[str] = []
    fds: list[int] = []
    sizes: list[int] = []
    try:
        for final, buffers in items:
            views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
            total = sum(v.nbytes for v in views)
            _inject_faults(final, total)
            tmp = os.path.join(tmp_dir, f"{os.getpid()}-{uuid.uuid4().hex}.tmp")
            fds.append(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE))
            tmps.append(tmp)
            _write_all(fds[-1], views)
            sizes.append(total)
        while fds:
            os.fsync(fds[0])
            os.close(fds.pop(0))
        dirs = []
        for (final, _), tmp in zip(items, tmps):
            parent = os.path.dirname(final)
            if parent not in dirs:
                ensure_dir(parent)
                dirs.append(parent)
            os.rename(tmp, final)
        for parent in dirs:
            fsync_dir(parent)
        return sizes
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        for tmp in tmps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            where = os.path.dirname(os.path.dirname(items[0][0]))
            raise StoreFull(f"no space left on device writing {len(items)} file(s) "
                            f"({sum(sum(memoryview(b).nbytes for b in bufs) for _, bufs in items)} bytes) under "
                            f"{where}: nothing was committed") from exc
        raise


def _write_all(fd: int, views: list[memoryview]) -> None:
    pending = views
    while pending:
        n = os.writev(fd, pending[:_IOV_MAX])
        while n and pending:
            if n >= pending[0].nbytes:
                n -= pending[0].nbytes
                pending = pending[1:]
            else:
                pending = [pending[0][n:], *pending[1:]]
                n = 0


@dataclass(frozen=True)
class BlobStat:
    hash: str
    encoding: str
    stored_bytes: int
    mtime: float


class BlobStore(ABC):
    """Immutable content-addressed blobs plus per-snapshot manifest files. No index, no policy."""

    supports_zero_copy_read: bool = False
    supports_compression: bool = False

    @abstractmethod
    def put(self, hash_: str, pieces: list[Piece], metadata: dict[str, str], encoding: str = "raw",
            level: int = 3) -> int: ...
    def put_many(self, items: list[tuple[str, list[Piece], dict[str, str]]]) -> list[int]:
        """Several raw blobs at once (a store may batch their syncs); returns the bytes written per blob."""
        return [self.put(h, pieces, metadata) for h, pieces, metadata in items]

    @abstractmethod
    def open(self, hash_: str, verify: bool = True) -> BlobReader: ...
    @abstractmethod
    def has(self, hash_: str) -> str | None: ...
    @abstractmethod
    def stat(self, hash_: str) -> BlobStat | None: ...
    @abstractmethod
    def delete(self, hash_: str) -> None: ...
    @abstractmethod
    def iter(self) -> Iterator[BlobStat]: ...
    @abstractmethod
    def put_manifest(self, snapshot_id: str, data: bytes) -> None: ...
    @abstractmethod
    def get_manifest(self, snapshot_id: str) -> bytes | None: ...
    @abstractmethod
    def delete_manifest(self, snapshot_id: str, quarantine: bool = False) -> None: ...
    @abstractmethod
    def iter_manifests(self) -> Iterator[str]: ...


class LocalBlobStore(BlobStore):
    """``<root>/blobs/ab/<hash>.safetensors|.kvz``, ``<root>/blobs/manifests/<id>.msgpack``, writes via ``<root>/tmp``."""

    supports_zero_copy_read = True
    supports_compression = True

    def __init__(self, root: str):
        self.root = root
        self.blob_dir = os.path.join(root, "blobs")
        self.manifest_dir = os.path.join(self.blob_dir, "manifests")
        self.tmp_dir = os.path.join(root, "tmp")
        for d in (self.blob_dir, self.manifest_dir, self.tmp_dir):
            ensure_dir(d)
        if len(os.listdir(self.blob_dir)) < 257:  # the 256 fan-out dirs, made once so saves never fsync a mkdir
            for k in range(256):
                os.makedirs(os.path.join(self.blob_dir, f"{k:02x}"), mode=DIR_MODE, exist_ok=True)
            fsync_dir(self.blob_dir)

    def path(self, hash_: str, encoding: str = "raw") -> str:
        return os.path.join(self.blob_dir, hash_[:2], hash_ + EXTENSIONS[encoding])

    def put(self, hash_: str, pieces: list[Piece], metadata: dict[str, str], encoding: str = "raw",
            level: int = 3) -> int:
        """Write one blob in ``encoding`` (zstd at ``level``), replacing its other form once durable."""
        buffers = raw_buffers(pieces, metadata) if encoding == "raw" else kvz_buffers(pieces, metadata, level)
        written = durable_write(self.path(hash_, encoding), self.tmp_dir, buffers)
        other = self.path(hash_, "zstd" if encoding == "raw" else "raw")
        if os.path.exists(other):  # a recompression replaces the other form only once the new one is durable
            os.unlink(other)
        return written

    def put_many(self, items: list[tuple[str, list[Piece], dict[str, str]]]) -> list[int]:
        return durable_write_many([(self.path(h), raw_buffers(p, m)) for h, p, m in items], self.tmp_dir)

    def open(self, hash_: str, verify: bool = True) -> BlobReader:
        encoding = self.has(hash_)
        if encoding is None:
            raise CorruptData(f"blob {hash_} is missing from {self.blob_dir}")
        return BlobReader(self.path(hash_, encoding), hash_ if verify else None)

    def has(self, hash_: str) -> str | None:
        for encoding in EXTENSIONS:
            if os.path.exists(self.path(hash_, encoding)):
                return encoding
        return None

    def stat(self, hash_: str) -> BlobStat | None:
        for encoding in EXTENSIONS:
            try:
                st = os.stat(self.path(hash_, encoding))
            except FileNotFoundError:
                continue
            return BlobStat(hash_, encoding, st.st_size, st.st_mtime)
        return None

    def delete(self, hash_: str) -> None:
        for encoding in EXTENSIONS:
            try:
                os.unlink(self.path(hash_, encoding))
            except FileNotFoundError:
                pass

    def iter(self) -> Iterator[BlobStat]:
        for sub in sorted(os.listdir(self.blob_dir)):
            d = os.path.join(self.blob_dir, sub)
            if len(sub) != 2 or not os.path.isdir(d):
                continue
            for name in sorted(os.listdir(d)):
                stem, _, ext = name.partition(".")
                encoding = {"safetensors": "raw", "kvz": "zstd"}.get(ext)
                if encoding is None or len(stem) != 32:
                    continue
                try:
                    st = os.stat(os.path.join(d, name))
                except FileNotFoundError:
                    continue
                yield BlobStat(stem, encoding, st.st_size, st.st_mtime)

    def _manifest_path(self, snapshot_id: str, quarantined: bool = False) -> str:
        return os.path.join(self.manifest_dir, snapshot_id + (".quarantined" if quarantined else ".msgpack"))

    def put_manifest(self, snapshot_id: str, data: bytes) -> None:
        durable_write(self._manifest_path(snapshot_id), self.tmp_dir, [data])

    def get_manifest(self, snapshot_id: str) -> bytes | None:
        try:
            with open(self._manifest_path(snapshot_id), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def delete_manifest(self, snapshot_id: str, quarantine: bool = False) -> None:
        try:
            if quarantine:
                os.rename(self._manifest_path(snapshot_id), self._manifest_path(snapshot_id, True))
            else:
                os.unlink(self._manifest_path(snapshot_id))
        except FileNotFoundError:
            pass

    def iter_manifests(self) -> Iterator[str]:
        for name in sorted(os.listdir(self.manifest_dir)):
            if name.endswith(".msgpack") and len(name) == 32 + 8:
                yield name[:32]

    def reap_tmp(self, dry_run: bool = False) -> list[str]:
        """Remove in-flight files of processes that no longer exist (crash residue)."""
        removed = []
        for name in os.listdir(self.tmp_dir):
            pid_text = name.split("-", 1)[0]
            if pid_text.isdigit() and pid_alive(int(pid_text)):
                continue
            removed.append(name)
            if not dry_run:
                try:
                    os.unlink(os.path.join(self.tmp_dir, name))
                except FileNotFoundError:
                    pass
        return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal still counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["BlobStore", "LocalBlobStore", "BlobStat", "durable_write", "durable_write_many", "ensure_dir", "fsync_dir", "FAULT_HOOK"]
