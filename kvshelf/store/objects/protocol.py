"""The byte-store seam: where a store's immutable objects (packs, manifests) live, whatever holds them.

Why a seam: the store's save and restore paths must not care whether bytes sit in a local directory, in memory (for
tests and for the conformance suite), or in a shared engine such as Redis. Every implementation keeps the same
contract, checked by one parametrised suite (``tests/store/test_byte_store_conformance.py``), as zarr-python does for its
stores:

* objects are immutable and named by the caller (``name`` is ``[A-Za-z0-9._/-]{1,255}``, no ``..``, no leading ``/``);
* ``put`` is all-or-nothing: after it returns the whole object is readable (and, where the medium has durability,
  durable); after a failure or a crash no partial object is visible under ``name``; putting a name that exists
  replaces it atomically (content-addressed callers only ever put the same bytes again);
* ``read_into`` fills caller-owned buffers from a byte range (no intermediate copy where the medium allows it) and
  raises :class:`ObjectMissing` for an absent object, :class:`~kvshelf.errors.CorruptData` for a range past its end;
* ``delete`` of an absent object is not an error; ``names(prefix)`` lists what exists under a prefix.

Errors: a full medium → :class:`~kvshelf.errors.StoreFull`; an unreachable one → :class:`BackendUnavailable`.

Optional capabilities are *declared* as class attributes (as zarr's ``supports_writes``/``supports_listing``), never
probed; the store takes a faster or safer path only where one is declared ``True``:

* ``supports_streaming``: ``put_stream(name, parts, *, durable=True) -> int`` — ``put`` of the buffers an iterator
  yields, written while the next part is computed (the save path hashes chunk k+1 while chunk k is written);
* ``local_paths``: ``path(name) -> str`` — the object is a file of this machine (a reader on a full disk locks it
  instead of publishing a lease; ``packs/`` is made once at open);
* ``reaps_tmp``: ``reap_tmp(dry_run=False) -> list[str]`` — the medium keeps tmp files of interrupted puts, and
  removes those whose writer died (at open and by ``gc``);
* ``opens_readers``: ``open_reader(name)`` — one reader (``read_into(offset, buffers)``, ``size()``, ``close()``,
  a context manager) for many ranged reads of one object.

An implementation that declares none of them (one written before they existed) has none: ``capability`` says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from ...errors import InvalidCacheState, KvShelfError

Buffer = bytes | bytearray | memoryview

_NAME = re.compile(r"[A-Za-z0-9._/-]{1,255}")


class ObjectMissing(KvShelfError, KeyError):
    """The named object does not exist in the byte store (never written, deleted, or evicted by the medium)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "object missing"


class BackendUnavailable(KvShelfError, OSError):
    """The medium could not be reached or did not answer in time; nothing was changed by this call."""


def check_name(name: str) -> str:
    """Refuse names that could escape a directory or collide across implementations."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name or name.startswith("/"):
        raise InvalidCacheState(f"invalid object name {name!r}")
    return name


CAPABILITIES = ("supports_streaming", "local_paths", "reaps_tmp", "opens_readers")


def capability(store, name: str) -> bool:
    """Whether ``store`` declares the optional capability ``name`` (one of ``CAPABILITIES``; see the module
    docstring). Undeclared is False."""
    if name not in CAPABILITIES:
        raise ValueError(f"unknown byte-store capability {name!r}")
    return getattr(store, name, False) is True


@runtime_checkable
class ByteStore(Protocol):
    """Immutable named objects with ranged reads into caller buffers. See the module docstring for the contract
    (and for the optional capabilities an implementation declares as class attributes)."""

    def put(self, name: str, buffers: Sequence[Buffer], *, durable: bool = True) -> int:
        """Store the concatenation of ``buffers`` as ``name``, all or nothing; returns its size in bytes.
        ``durable=False`` may skip the medium's syncs (still all or nothing; may be lost in a power cut)."""
        ...

    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order with the bytes ``[offset, offset + Σ len(buffers))`` of ``name``."""
        ...

    def size(self, name: str) -> int | None:
        """The object's size in bytes, or None when it does not exist."""
        ...

    def exists(self, name: str) -> bool:
        ...

    def delete(self, name: str) -> None:
        ...

    def names(self, prefix: str = "") -> Iterator[str]:
        """Every existing object whose name starts with ``prefix`` (any order)."""
        ...


def put_unsynced(store: ByteStore, name: str, buffers: Sequence[Buffer]) -> int:
    """``put(..., durable=False)`` — on an implementation written before that keyword existed, a durable put."""
    try:
        return store.put(name, buffers, durable=False)
    except TypeError:
        return store.put(name, buffers)




def open_object(store, name: str):
    """A reader over one object of any ByteStore: the local fast path, or ranged reads through the protocol."""
    if capability(store, "opens_readers"):
        return store.open_reader(name)
    return _ProtocolReader(store, name)


class _ProtocolReader:
    def __init__(self, store, name: str):
        self.store, self.name = store, name
        if not store.exists(name):
            raise ObjectMissing(f"object {name!r} does not exist")

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        self.store.read_into(self.name, offset, buffers)

    def size(self) -> int:
        n = self.store.size(self.name)
        if n is None:
            raise ObjectMissing(f"object {self.name!r} does not exist")
        return n

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


__all__ = ["BackendUnavailable", "Buffer", "ByteStore", "CAPABILITIES", "ObjectMissing", "capability", "check_name", "open_object",
           "put_unsynced"]
