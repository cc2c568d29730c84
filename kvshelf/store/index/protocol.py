"""The index-transaction seam: named tables of sorted byte keys, read snapshots and atomic write transactions.

Why: the store's index must be pluggable like its bytes (``protocol.ByteStore``): ``Store`` and its rooms speak only
this protocol, so LMDB (``lmdb_env.Index``, the default) and process memory (``MemoryIndexStore``) are
interchangeable, and a shared tier can keep the index elsewhere. The contract every implementation keeps (one
conformance suite, ``tests/store/test_index_store_conformance.py``):

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

``translate_error(exc)`` turns an exception the implementation's own library raised while a caller consumed a
streamed batch (outside the ``read()`` block's own translation) into the ``KvShelfError`` it means, or returns None
when ``exc`` is not the implementation's: nothing of the library leaks past this seam.

Optional capabilities are *declared* as class attributes (never probed; undeclared is False, ``capability``):

* ``supports_page_stats``: ``page_stats() -> (page size, {table: stats})`` — the index is pages on this disk, so a
  delete's commit can need fresh pages (``space/reserve.py`` sizes the full-disk reserve from them);
* ``lmdb_directory``: ``path`` is an LMDB environment directory that the offline tools copy (``copy_to(target)``),
  replace while it is closed and open again (``reopen()``, ``map_size()``); ``users`` counts this process's open
  handles on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

from ...errors import CorruptData, KvShelfError

_T = TypeVar("_T")
SCAN_BATCH = 512  # records per read transaction of a streaming listing (Batching.scan)
PLAIN_TABLES = ("meta", "manifests", "summaries", "tokens", "sessions", "chunks", "packs", "lru", "quarantine",
                "heads",
                "pins",  # space/pins.py: sessions the budget never evicts
                "bad_chunks")  # integrity/bad_chunks.py: chunk copies that failed their hash, never deduped onto
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
    def translate_error(self, exc: BaseException) -> KvShelfError | None: ...


INDEX_CAPABILITIES = ("supports_page_stats", "lmdb_directory")


def capability(index, name: str) -> bool:
    """Whether ``index`` declares the optional capability ``name`` (one of ``INDEX_CAPABILITIES``; see the module
    docstring). Undeclared is False."""
    if name not in INDEX_CAPABILITIES:
        raise ValueError(f"unknown index-store capability {name!r}")
    return getattr(index, name, False) is True


def check_table(name: str, dup: bool) -> str:
    if name not in (DUP_TABLES if dup else PLAIN_TABLES):
        kind = "duplicate" if dup else "plain"
        raise KvShelfError(f"index table {name!r} is not a {kind} table of the store's index")
    return name


class Batching:
    """``scan`` / ``batches`` on any ``read()`` + ``range``: short transactions, bounded memory and reader time."""

    def translate_error(self, exc: BaseException) -> KvShelfError | None:
        """An implementation whose transactions raise only ``KvShelfError`` has nothing to translate."""
        return None

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


__all__ = ["Batching", "DUP_TABLES", "INDEX_CAPABILITIES", "IndexStore", "IndexTxn", "PLAIN_TABLES", "SCAN_BATCH",
           "capability", "check_table", "meta_int", "set_meta_int"]
