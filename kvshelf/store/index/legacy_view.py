"""``LegacyView``: an index of an older format (or one missing a table added since) read as it is, without writing.

Why: a writing open upgrades an index of format 1 or 2 in one write transaction (``lmdb_env.Index._check_format``)
and creates any table added since (``pins``, ``bad_chunks``, ...) when it opens it. A handle that may not write the
store (``store/liveness/access.py``: another user's store, a read-only mount) can do neither — and must not: the upgrade is
the owner's next open's — so without this it could not read such a store at all. What the upgrade changes that reads
depend on is small: the prefix records (format 3 tags them by session lineage and adds ``heads``; format 2 tagged
them by snapshot, format 1 held bare snapshot ids) and the tables an older index lacks, which are empty there since
nothing that fills them existed yet. Every other table reads the same in every format (v1 records are bare msgpack,
decoded as they are: ``schema.unseal``). So a read-only handle keeps those tables in process memory: the prefix
records and heads are derived once at open by the very function the upgrade runs (``prefix/records.rebuild_table``,
handed in by the store, as for the upgrade), from the file's ``sessions`` and ``tokens``; the missing tables are
empty; every other table is read from the file.

What that gives up, and why it is safe: the derived records are those of the index at open. The owner's next open
upgrades the file in place and may then save, delete or replace sessions; this handle's lookups keep nominating
from the records of its open (a replaced or deleted snapshot is skipped when its summary is gone, a later save is
not found), while sessions, manifests and chunks are read from the file as it is now. Tokens are always compared and
every chunk is hash-checked, so a stale record can cost a hit, never return wrong bytes; a fresh open sees it all.
The cost is one pass over every session's tokens at open (hashing at memory speed) and the records in memory: about
25 bytes per token of the sessions' current snapshots, paid only by read-only handles of older stores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .memory import MemoryIndexStore
from .protocol import IndexTxn

DERIVED = ("prefix", "heads")  # what the format-3 upgrade rewrites (records.rebuild_table), derived here instead


class _Routed:
    """One ``IndexTxn`` over two: tables in ``local`` go to the in-memory ``mem``, every other to the file's
    ``disk`` (its snapshot names the transaction: ``id``)."""

    __slots__ = ("disk", "mem", "local")

    def __init__(self, disk: IndexTxn, mem: IndexTxn, local: frozenset[str]):
        self.disk, self.mem, self.local = disk, mem, local

    def _of(self, table: str) -> IndexTxn:
        return self.mem if table in self.local else self.disk

    def id(self) -> int:
        return self.disk.id()

    def get(self, table: str, key: bytes) -> bytes | None:
        return self._of(table).get(table, key)

    def put(self, table: str, key: bytes, value: bytes) -> None:
        self._of(table).put(table, key, value)

    def delete(self, table: str, key: bytes) -> bool:
        return self._of(table).delete(table, key)

    def range(self, table: str, start: bytes = b"", stop: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        return self._of(table).range(table, start, stop)

    def count(self, table: str) -> int:
        return self._of(table).count(table)

    def clear(self, table: str) -> None:
        self._of(table).clear(table)

    def dup_add(self, table: str, key: bytes, value: bytes) -> None:
        self._of(table).dup_add(table, key, value)

    def dup_remove(self, table: str, key: bytes, value: bytes) -> bool:
        return self._of(table).dup_remove(table, key, value)

    def dup_has(self, table: str, key: bytes, value: bytes) -> bool:
        return self._of(table).dup_has(table, key, value)

    def dup_count(self, table: str, key: bytes) -> int:
        return self._of(table).dup_count(table, key)

    def dup_from(self, table: str, key: bytes, value: bytes) -> Iterator[bytes]:
        return self._of(table).dup_from(table, key, value)

    def dup_below(self, table: str, key: bytes, value: bytes | None = None) -> Iterator[bytes]:
        return self._of(table).dup_below(table, key, value)

    def dup_items(self, table: str) -> Iterator[tuple[bytes, bytes]]:
        return self._of(table).dup_items(table)


class LegacyView:
    """The in-memory tables of a read-only handle on an older index (module docstring). ``missing``: tables the
    file lacks (read as empty); ``derive(txn)``: the format upgrade's prefix re-tagging, run once here over the
    file's snapshot ``disk`` (None: the format is current, nothing is derived)."""

    def __init__(self, disk: IndexTxn, missing: tuple[str, ...], derive: Callable[[IndexTxn], object] | None):
        self.local = frozenset(missing) | (frozenset(DERIVED) if derive is not None else frozenset())
        memory = MemoryIndexStore()
        if derive is not None:
            memory.write(lambda mem: derive(_Routed(disk, mem, self.local)))
        # nothing writes these tables after this (the handle is read-only): one snapshot serves every read
        with memory.read() as mem:
            self._mem = mem

    def over(self, disk: IndexTxn) -> IndexTxn:
        """A read transaction of the file, with this view's tables in place of the file's."""
        return _Routed(disk, self._mem, self.local)


__all__ = ["DERIVED", "LegacyView"]
