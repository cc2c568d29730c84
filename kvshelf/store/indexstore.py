"""The index-transaction seam: named tables of sorted byte keys, read snapshots and atomic write transactions.

Why: the store's index must be pluggable like its bytes (``backend.ByteStore``): ``Store`` and its rooms speak only
this protocol, so LMDB (``lmdbindex.LmdbIndexStore``, the default) and process memory (``MemoryIndexStore``) are
interchangeable, and a shared tier can keep the index elsewhere. The contract every implementation keeps (one
conformance suite, ``tests/test_index_store_conformance.py``):

* ``read()`` is a context manager yielding a transaction that sees one consistent snapshot for its whole life
  (writes committed meanwhile are invisible to it);
* ``write(fn)`` runs ``fn(txn)`` as ONE atomic transaction: every change is visible after it returns, none if ``fn``
  raises (the exception propagates); writers are serialized (``writer_lock()`` is the lock they run under);
* plain tables: ``get``, ``put`` (replaces), ``delete -> bool``, ``range(table, start, stop)`` (keys in
  ``[start, stop)`` ascending), ``count``, ``clear``; a write transaction sees its own changes;
* duplicate tables (``DUP_TABLES``: one key, many sorted values — the prefix records): ``dup_add``,
  ``dup_remove -> bool``, ``dup_has``, ``dup_count(table, key)``, ``dup_from(table, key, value)`` (that key's
  values ``>= value`` ascending), ``dup_below(table, key, value)`` (values ``< value`` descending; ``None``: all),
  ``dup_items(table)`` (every pair in order); ``count`` of a duplicate table counts pairs;
* ``txn.id()`` names the snapshot: two reads with one id saw the same committed state.

``scan`` and ``batches`` (``Batching``) stream a table in short read transactions, for every implementation alike.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar, runtime_checkable

from ..errors import CorruptData, KvShelfError

_T = TypeVar("_T")
SCAN_BATCH = 512  # records per read transaction of a streaming listing (Batching.scan)
PLAIN_TABLES = ("meta", "manifests", "summaries", "tokens", "sessions", "chunks", "packs", "lru", "quarantine",
                "heads")
DUP_TABLES = ("prefix",)


@runtime_checkable
class IndexTxn(Protocol):
    def get(self, table: str, key: bytes) -> bytes | None: ...
    def put(self, table: str, key: bytes, value: bytes) -> None: ...
    def delete(self, table: str, key: bytes) -> bool: ...
    def range(self, table: str, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]: ...
    def count(self, table: str) -> int: ...
    def clear(self, table: str) -> None: ...
    def id(self) -> int: ...
    def dup_add(self, table: str, key: bytes, value: bytes) -> None: ...
    def dup_remove(self, table: str, key: bytes, value: bytes) -> bool: ...
    def dup_has(self, table: str, key: bytes, value: bytes) -> bool: ...
    def dup_count(self, table: str, key: bytes) -> int: ...
    def dup_from(self, table: str, key: bytes, value: bytes) -> Iterator[bytes]: ...
    def dup_below(self, table: str, key: bytes, value: bytes | None = None) -> Iterator[bytes]: ...
    def dup_items(self, table: str) -> Iterator[tuple[bytes, bytes]]: ...


@runtime_checkable
class IndexStore(Protocol):
    path: str

    def read(self): ...
    def write(self, fn: Callable[[IndexTxn], _T]) -> _T: ...
    def writer_lock(self): ...
    def scan(self, table: str, batch: int = SCAN_BATCH, *, start: bytes | None = None,
             stop: bytes | None = None, ids: set[int] | None = None) -> Iterator[tuple[bytes, bytes]]: ...
    def batches(self, table: str, batch: int = SCAN_BATCH, *, start: bytes | None = None,
                stop: bytes | None = None) -> Iterator[tuple[IndexTxn, list]]: ...
    def close(self) -> None: ...


def check_table(name: str, dup: bool) -> str:
    if name not in (DUP_TABLES if dup else PLAIN_TABLES):
        kind = "duplicate" if dup else "plain"
        raise KvShelfError(f"index table {name!r} is not a {kind} table of the store's index")
    return name


class Batching:
    """``scan`` / ``batches`` on any ``read()`` + ``range``: short transactions, bounded memory and reader time."""

    def scan(self, table: str, batch: int = SCAN_BATCH, *, start: bytes | None = None, stop: bytes | None = None,
             ids: set[int] | None = None):
        """Every (key, value) of plain table ``table`` with ``start <= key < stop``, read in short transactions of
        ``batch`` records each (a listing sees each key once, in key order; records committed meanwhile may or may
        not be seen). Each batch's transaction id is added to ``ids``: one id for a whole listing means nothing
        was committed between its batches, so it saw one consistent snapshot."""
        for _txn, txn_id, rows in self._batches(table, batch, start, stop, hold=False):
            if ids is not None:
                ids.add(txn_id)
            yield from rows

    def batches(self, table: str, batch: int = SCAN_BATCH, *, start: bytes | None = None,
                stop: bytes | None = None):
        """``scan``'s batches as ``(txn, rows)``, each yielded while its read transaction is still open, so the
        caller checks the rows against other tables in that same snapshot (``txn.id()`` names it)."""
        for txn, _txn_id, rows in self._batches(table, batch, start, stop, hold=True):
            yield txn, rows

    def _batches(self, table: str, batch: int, start: bytes | None, stop: bytes | None, hold: bool):
        after: bytes | None = None
        while True:
            with self.read() as txn:
                rows, more = [], False
                for key, value in txn.range(table, after if after is not None else (start or b""), stop):
                    if key == after:
                        continue
                    if len(rows) == batch:
                        more = True
                        break
                    rows.append((key, value))
                txn_id = txn.id()
                if hold and rows:
                    yield txn, txn_id, rows
            if not hold and rows:
                yield None, txn_id, rows
            if not more:
                return
            after = rows[-1][0]


# ---------------------------------------------------------------------------------------------------------------
class _MemoryTxn:
    """Tables are dicts; a duplicate table maps a key to a sorted list of values. A write transaction copies a
    table (and a duplicate key's list) before its first change, so snapshots held by readers never move."""

    def __init__(self, tables: dict[str, dict], writable: bool, txn_id: int):
        self._tables, self._writable, self._id = tables, writable, txn_id
        self._copied: set[str] = set()
        self._sorted: dict[str, list[bytes]] = {}

    def _table(self, name: str, dup: bool = False, change: bool = False) -> dict:
        check_table(name, dup)
        if not change:
            return self._tables.get(name, {})
        if not self._writable:
            raise TypeError("a change in a read transaction")
        self._sorted.pop(name, None)
        if name not in self._copied:
            self._tables[name] = dict(self._tables.get(name, {}))
            self._copied.add(name)
        return self._tables[name]

    def id(self) -> int:
        return self._id

    def get(self, table: str, key: bytes) -> bytes | None:
        return self._table(table).get(bytes(key))

    def put(self, table: str, key: bytes, value: bytes) -> None:
        self._table(table, change=True)[bytes(key)] = bytes(value)

    def delete(self, table: str, key: bytes) -> bool:
        return self._table(table, change=True).pop(bytes(key), None) is not None

    def clear(self, table: str) -> None:
        self._table(table, dup=table in DUP_TABLES, change=True).clear()

    def range(self, table: str, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        data = self._table(table)
        keys = self._sorted.get(table)
        if keys is None:
            keys = self._sorted[table] = sorted(data)
        for k in keys[bisect.bisect_left(keys, bytes(start)):]:
            if stop is not None and k >= stop:
                break
            if k in data:
                yield k, data[k]

    def count(self, table: str) -> int:
        if table in DUP_TABLES:
            return sum(len(v) for v in self._table(table, dup=True).values())
        return len(self._table(table))

    # --- duplicate tables ---------------------------------------------------------------------------------------
    def _values(self, table: str, key: bytes) -> list[bytes]:
        return self._table(table, dup=True).get(bytes(key), [])

    def dup_add(self, table: str, key: bytes, value: bytes) -> None:
        data = self._table(table, dup=True, change=True)
        values, value = list(data.get(bytes(key), [])), bytes(value)
        at = bisect.bisect_left(values, value)
        if at == len(values) or values[at] != value:
            values.insert(at, value)
        data[bytes(key)] = values

    def dup_remove(self, table: str, key: bytes, value: bytes) -> bool:
        if not self.dup_has(table, key, value):
            return False
        data, value = self._table(table, dup=True, change=True), bytes(value)
        values = [v for v in data[bytes(key)] if v != value]
        if values:
            data[bytes(key)] = values
        else:
            del data[bytes(key)]
        return True

    def dup_has(self, table: str, key: bytes, value: bytes) -> bool:
        values = self._values(table, key)
        value = bytes(value)
        at = bisect.bisect_left(values, value)
        return at < len(values) and values[at] == value

    def dup_count(self, table: str, key: bytes) -> int:
        return len(self._values(table, key))

    def dup_from(self, table: str, key: bytes, value: bytes) -> Iterator[bytes]:
        values = self._values(table, key)
        yield from values[bisect.bisect_left(values, bytes(value)):]

    def dup_below(self, table: str, key: bytes, value: bytes | None = None) -> Iterator[bytes]:
        values = self._values(table, key)
        yield from reversed(values[:len(values) if value is None else bisect.bisect_left(values, bytes(value))])

    def dup_items(self, table: str) -> Iterator[tuple[bytes, bytes]]:
        data = self._table(table, dup=True)
        for k in sorted(data):
            for v in data[k]:
                yield k, v


class MemoryIndexStore(Batching):
    """Tables in process memory: a write transaction works on copies of the tables it changes and swaps them in at
    the end (atomic; a raising ``fn`` leaves nothing); readers keep the snapshot they started with. For tests, a
    throwaway store, and as the second implementation that keeps the seam honest."""

    path = "<memory>"

    def __init__(self) -> None:
        self._state: tuple[dict[str, dict], int] = ({}, 0)  # (tables, version): swapped as ONE reference
        self._lock = threading.RLock()

    @contextmanager
    def read(self) -> Iterator[_MemoryTxn]:
        tables, version = self._state  # one read: the id always names the tables it goes with
        yield _MemoryTxn(dict(tables), writable=False, txn_id=version)

    def write(self, fn: Callable[[IndexTxn], _T]) -> _T:
        with self._lock:
            tables, version = self._state
            work = dict(tables)
            result = fn(_MemoryTxn(work, writable=True, txn_id=version + 1))
            self._state = (work, version + 1)
            return result

    def writer_lock(self) -> threading.RLock:
        return self._lock

    def close(self) -> None:
        pass


def meta_int(txn: IndexTxn, name: bytes, default: int = 0, where: str = "the index") -> int:
    """A signed 64-bit meta record; a record of the wrong length is damage, said as ``CorruptData``."""
    raw = txn.get("meta", name)
    if raw is None:
        return default
    if len(raw) != 8:
        raise CorruptData(f"{where}: meta record {name.decode(errors='replace')!r} is {len(raw)} bytes, not 8 "
                          f"(damaged)")
    return int.from_bytes(raw, "little", signed=True)


def set_meta_int(txn: IndexTxn, name: bytes, value: int) -> None:
    txn.put("meta", name, int(value).to_bytes(8, "little", signed=True))


__all__ = ["Batching", "DUP_TABLES", "IndexStore", "IndexTxn", "MemoryIndexStore", "PLAIN_TABLES", "SCAN_BATCH",
           "meta_int", "set_meta_int"]
