"""The index in process memory: the second implementation of the index-transaction protocol (``protocol.py``).

Why it exists: a throwaway store (tests, one process's scratch space) needs no LMDB file, and a second implementation
keeps the seam honest — the conformance suite runs on both.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from .protocol import DUP_TABLES, Batching, IndexTxn, check_table

_T = TypeVar("_T")


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
    supports_page_stats = False  # process memory: a delete needs no disk page
    lmdb_directory = False

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


__all__ = ["MemoryIndexStore"]
