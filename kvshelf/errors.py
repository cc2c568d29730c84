"""The one error root of kvshelf.

Every rejected call raises a subclass of :class:`KvShelfError`, named for what the
caller can do about it.  Where a builtin already carries that meaning the class
also derives from it (``SnapshotNotFound`` is a ``KeyError``, a bad shape is a
``ValueError``), so generic ``except`` clauses in serving code keep working.
A rejected call never leaves a cache or the store half-changed.
"""

from __future__ import annotations


class KvShelfError(Exception):
    """Root of every error kvshelf raises on purpose."""


class InvalidCacheState(KvShelfError, ValueError):
    """Bad shapes, dtypes, row indices, or batched rows where a serial row is needed."""


class WrongArgumentType(InvalidCacheState, TypeError):
    """An argument of the wrong type (a non-str session id, a float token, an int namespace); also a ``TypeError``."""


class CacheRangeError(InvalidCacheState, IndexError):
    """A position or row count outside what the cache holds (trim too far, maxTokens exceeded, row out of range)."""


class IncompatibleFormat(KvShelfError, ValueError):
    """An unknown provider id, cache kind or format version, or a header that contradicts its own geometry."""


class CorruptData(KvShelfError):
    """Stored bytes failed verification: a checksum, a truncated file, a header that does not decode."""


class EncryptionKeyError(KvShelfError):
    """A store encrypted at rest opened without its key or with a wrong one, or a chunk whose tenant's data key was
    destroyed (``forget_tenant``): never garbage, never a raw exception. The message names the store, never a key."""


class IdentityMismatch(KvShelfError):
    """A snapshot was made under another model identity or namespace than the caller expects."""

    def __init__(self, field: str, stored: object, expected: object, what: str = "snapshot") -> None:
        self.field, self.stored, self.expected = field, stored, expected
        super().__init__(f"{what} {field} mismatch: stored {stored!r}, expected {expected!r}")


class SnapshotNotFound(KvShelfError, KeyError):
    """No snapshot or session under that id (in this identity and namespace)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "snapshot not found"


class StoreFull(KvShelfError, OSError):
    """The disk (ENOSPC) or the byte budget cannot take a write; nothing was committed."""


class FileAccessError(KvShelfError, OSError):
    """A file could not be opened, read or written (a directory, no permission, an I/O error, not a regular file);
    also an ``OSError`` carrying the original ``errno`` and filename."""


class FileMissing(FileAccessError, FileNotFoundError):
    """The file (or its directory) does not exist; also a ``FileNotFoundError``."""


class StoreReadOnly(FileAccessError, PermissionError):
    """The store was opened read-only (this process may not write it, or it lives on a read-only file system) and
    the call would change it (a save, a delete, a pin, maintenance). ``errno`` is ``EACCES`` or ``EROFS``; the
    message names the path that cannot be written and the call; also a ``PermissionError``."""


class StoreBusy(KvShelfError):
    """The store is in use by someone else (another process, another handle, a save) and the call needs it alone."""


__all__ = [
    "KvShelfError",
    "InvalidCacheState",
    "WrongArgumentType",
    "CacheRangeError",
    "IncompatibleFormat",
    "EncryptionKeyError",
    "CorruptData",
    "IdentityMismatch",
    "SnapshotNotFound",
    "StoreFull",
    "FileAccessError",
    "FileMissing",
    "StoreReadOnly",
    "StoreBusy",
]


def file_error(exc: OSError, what: str) -> FileAccessError:
    """The kvshelf form of an ``OSError`` met while opening, reading or writing ``what`` (errno and filename kept)."""
    import errno as _errno

    cls = FileMissing if isinstance(exc, FileNotFoundError) or exc.errno == _errno.ENOENT else FileAccessError
    err = cls(exc.errno or _errno.EIO, f"{what}: {exc.strerror or exc}", exc.filename)
    err.__cause__ = exc
    return err
