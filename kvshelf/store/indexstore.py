"""The index-transaction seam: named tables of sorted byte keys, read snapshots and atomic write transactions.

Why: the store's index must be pluggable like its bytes (``backend.ByteStore``) — a shared tier keeps it elsewhere.
The contract every implementation keeps (one conformance suite, ``tests/test_index_store_conformance.py``):

* ``read()`` is a context manager yielding a transaction that sees one consistent snapshot for its whole life
  (writes committed meanwhile are invisible to it);
* ``write(fn)`` runs ``fn(txn)`` as ONE atomic transaction: every change is visible after it returns, none if ``fn``
  raises (the exception propagates); writers are serialized;
* within a transaction: ``get(table, key)``, ``put(table, key, value)``, ``delete(table, key) -> bool``,
  ``range(table, start=b"", stop=None)`` (keys in ``[start, stop)`` in ascending byte order), ``count(table)``; a
  write transaction sees its own changes.

``LmdbIndexStore`` adapts the store's LMDB environment (``index.Index``); ``MemoryIndexStore`` keeps tables in
process memory (copy-on-write per write transaction). Status: the ``Store`` itself still speaks to LMDB through
``index.Index`` directly; moving its rooms (``ledger``, ``leasing``, ``lookup``, ``maintenance``) onto this seam is
the next step.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar, runtime_checkable

_T = TypeVar("_T")


@runtime_checkable
class IndexTxn(Protocol):
    def get(self, table: str, key: bytes) -> bytes | None: ...
    def put(self, table: str, key: bytes, value: bytes) -> None: ...
    def delete(self, table: str, key: bytes) -> bool: ...
    def range(self, table: str, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]: ...
    def count(self, table: str) -> int: ...


@runtime_checkable
class IndexStore(Protocol):
    def read(self): ...
    def write(self, fn: Callable[[IndexTxn], _T]) -> _T: ...


# ---------------------------------------------------------------------------------------------------------------
class _MemoryTxn:
    def __init__(self, tables: dict[str, dict[bytes, bytes]], writable: bool):
        self._tables, self._writable = tables, writable
        self._sorted: dict[str, list[bytes]] = {}

    def _table(self, name: str) -> dict[bytes, bytes]:
        return self._tables.setdefault(name, {}) if self._writable else self._tables.get(name, {})

    def get(self, table: str, key: bytes) -> bytes | None:
        return self._table(table).get(bytes(key))

    def put(self, table: str, key: bytes, value: bytes) -> None:
        if not self._writable:
            raise TypeError("put in a read transaction")
        self._table(table)[bytes(key)] = bytes(value)
        self._sorted.pop(table, None)

    def delete(self, table: str, key: bytes) -> bool:
        if not self._writable:
            raise TypeError("delete in a read transaction")
        self._sorted.pop(table, None)
        return self._table(table).pop(bytes(key), None) is not None

    def range(self, table: str, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        data = self._table(table)
        keys = self._sorted.get(table)
        if keys is None:
            keys = self._sorted[table] = sorted(data)
        at = bisect.bisect_left(keys, bytes(start))
        for k in keys[at:]:
            if stop is not None and k >= stop:
                break
            if k in data:
                yield k, data[k]

    def count(self, table: str) -> int:
        return len(self._table(table))


class MemoryIndexStore:
    """Tables in process memory. A write transaction works on copies of the tables and swaps them in at the end
    (atomic; a raising ``fn`` leaves nothing); readers keep the snapshot they started with."""

    def __init__(self) -> None:
        self._tables: dict[str, dict[bytes, bytes]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def read(self) -> Iterator[_MemoryTxn]:
        yield _MemoryTxn(dict(self._tables), writable=False)  # tables are replaced, never mutated: a snapshot

    def write(self, fn: Callable[[IndexTxn], _T]) -> _T:
        with self._lock:
            work = {name: dict(t) for name, t in self._tables.items()}
            result = fn(_MemoryTxn(work, writable=True))
            self._tables = work
            return result


# ---------------------------------------------------------------------------------------------------------------
class _LmdbTxn:
    def __init__(self, index, txn):
        self._index, self._txn = index, txn

    def _db(self, table: str):
        return self._index.table(table)

    def get(self, table: str, key: bytes) -> bytes | None:
        v = self._txn.get(bytes(key), db=self._db(table))
        return None if v is None else bytes(v)

    def put(self, table: str, key: bytes, value: bytes) -> None:
        self._txn.put(bytes(key), bytes(value), db=self._db(table))

    def delete(self, table: str, key: bytes) -> bool:
        return self._txn.delete(bytes(key), db=self._db(table))

    def range(self, table: str, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        cur = self._txn.cursor(db=self._db(table))
        if not cur.set_range(bytes(start)):
            return
        for k, v in cur:
            k = bytes(k)
            if stop is not None and k >= stop:
                break
            yield k, bytes(v)

    def count(self, table: str) -> int:
        return self._txn.stat(self._db(table))["entries"]


class LmdbIndexStore:
    """The seam over an ``index.Index`` (LMDB: MVCC read snapshots, one writer, ``write`` retried on a full map)."""

    def __init__(self, index) -> None:
        self.index = index

    @contextmanager
    def read(self) -> Iterator[_LmdbTxn]:
        with self.index.read() as txn:
            yield _LmdbTxn(self.index, txn)

    def write(self, fn: Callable[[IndexTxn], _T]) -> _T:
        return self.index.write(lambda txn: fn(_LmdbTxn(self.index, txn)))


__all__ = ["IndexStore", "IndexTxn", "LmdbIndexStore", "MemoryIndexStore"]
