"""One LMDB transaction as an ``protocol.IndexTxn``: table names instead of database handles, cursors kept inside.

Why a separate room: ``lmdb_env.Index`` owns the environment (open, format, growth, errors); this file is only the
translation of the protocol's calls onto ``lmdb.Transaction`` and its cursors, so no room above the index ever
holds an LMDB handle. Duplicate tables are LMDB ``dupsort`` databases: ``dup_count`` is O(1) on the cursor.
"""

from __future__ import annotations

from collections.abc import Iterator

import lmdb

from .protocol import DUP_TABLES, check_table


class LmdbTxn:
    __slots__ = ("raw", "_dbs", "_cursors")

    def __init__(self, raw: lmdb.Transaction, dbs: dict):
        self.raw, self._dbs = raw, dbs
        self._cursors: dict[str, lmdb.Cursor] = {}

    def _db(self, table: str, dup: bool = False):
        db = self._dbs.get(table)
        if db is None or (table in DUP_TABLES) != dup:
            check_table(table, dup)
        return db

    def _cursor(self, table: str) -> lmdb.Cursor:
        cur = self._cursors.get(table)
        if cur is None:
            cur = self._cursors[table] = self.raw.cursor(db=self._db(table, dup=True))
        return cur

    def id(self) -> int:
        return self.raw.id()

    # --- plain tables ---------------------------------------------------------------------------------------------
    def get(self, table: str, key: bytes) -> bytes | None:
        return self.raw.get(key, db=self._db(table))

    def put(self, table: str, key: bytes, value: bytes) -> None:
        self.raw.put(key, value, db=self._db(table))

    def delete(self, table: str, key: bytes) -> bool:
        return self.raw.delete(key, db=self._db(table))

    def range(self, table: str, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        cur = self.raw.cursor(db=self._db(table))
        if not (cur.set_range(start) if start else cur.first()):
            return
        for k, v in cur:
            if stop is not None and k >= stop:
                break
            yield k, v

    def count(self, table: str) -> int:
        return self.raw.stat(self._db(table, dup=table in DUP_TABLES))["entries"]

    def clear(self, table: str) -> None:
        self.raw.drop(self._db(table, dup=table in DUP_TABLES), delete=False)

    # --- duplicate tables -----------------------------------------------------------------------------------------
    def dup_add(self, table: str, key: bytes, value: bytes) -> None:
        self.raw.put(key, value, db=self._db(table, dup=True), dupdata=True)

    def dup_remove(self, table: str, key: bytes, value: bytes) -> bool:
        self._cursors.pop(table, None)  # a cached cursor may sit on the pair removed
        return self.raw.delete(key, value, db=self._db(table, dup=True))

    def dup_has(self, table: str, key: bytes, value: bytes) -> bool:
        return self._cursor(table).set_key_dup(key, value)

    def dup_count(self, table: str, key: bytes) -> int:
        cur = self._cursor(table)
        return cur.count() if cur.set_key(key) else 0

    def dup_from(self, table: str, key: bytes, value: bytes) -> Iterator[bytes]:
        cur = self.raw.cursor(db=self._db(table, dup=True))
        ok = cur.set_range_dup(key, value) if value else cur.set_key(key)  # LMDB refuses an empty value
        while ok:
            yield cur.value()
            ok = cur.next_dup()

    def dup_below(self, table: str, key: bytes, value: bytes | None = None) -> Iterator[bytes]:
        cur = self.raw.cursor(db=self._db(table, dup=True))
        if value == b"":
            return  # nothing sorts below the empty value
        if value is not None and cur.set_range_dup(key, value):
            ok = cur.prev_dup()
        else:  # no value >= ``value`` (or none asked): start from the key's last
            ok = cur.set_key(key) and cur.last_dup()
        while ok:
            yield cur.value()
            ok = cur.prev_dup()

    def dup_items(self, table: str) -> Iterator[tuple[bytes, bytes]]:
        yield from self.raw.cursor(db=self._db(table, dup=True))


__all__ = ["LmdbTxn"]
