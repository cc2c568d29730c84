"""Bad chunk marks: the chunk copies that failed their hash, so no save ever dedupes onto them again.

Why a table of its own: a chunk is named by its content, and a save dedupes against every ``chunks`` record — so a
copy whose bytes were damaged would otherwise be reused by every later save of the same content, and the session
would fail (and be quarantined, and prefill cold) after every restart. The mark is written in the same write
transaction that quarantines the snapshot whose restore found the damage (``integrity/quarantine.py``), and names
the *copy* (pack and offset) that failed: a chunk repointed at a fresh copy since is not marked. A save treats a
marked chunk as absent and writes a fresh, verified copy; its commit (``ledger.commit``) repoints the chunk record
at the new bytes and clears the mark, which heals every other snapshot that referenced the damaged copy. A mark
whose chunk record goes (its last reference dropped) goes with it. ``verify`` reports each remaining mark with the
sessions it affects; ``repair`` rewrites it from a good copy or drops what cannot be read.

Record: key the 16-byte chunk hash, value msgpack ``[pack, offset, reason, marked ns]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from . import keys
from . import schema
from .schema import ChunkMeta

TABLE = "bad_chunks"


@dataclass(frozen=True)
class BadMark:
    hash: str
    pack: str
    offset: int
    reason: str
    marked_ns: int


def _decode(key: bytes, raw: bytes) -> BadMark:
    try:
        pack, offset, reason, ns = msgspec.msgpack.decode(raw)
        return BadMark(bytes(key).hex(), str(pack), int(offset), str(reason), int(ns))
    except (msgspec.DecodeError, ValueError, TypeError):
        return BadMark(bytes(key).hex(), "", 0, "(the bad-chunk record itself is damaged)", 0)


def mark(txn, hash_: str, where: tuple, reason: str) -> bool:
    """Mark the copy of ``hash_`` at ``where`` (object, offset, ...) bad if the chunk record still points there.
    True when a mark was written."""
    key = bytes.fromhex(hash_)
    raw = txn.get("chunks", key)
    if raw is None:
        return False
    meta = schema.decode(raw, ChunkMeta, f"chunk record {hash_}")
    obj, offset, _length = keys.location(hash_, meta)
    if (obj, offset) != (where[0], where[1]):
        return False  # repointed at another copy since the read: that copy was not found bad
    txn.put(TABLE, key, msgspec.msgpack.encode([obj, offset, reason[:500], time.time_ns()]))
    return True


def is_bad(txn, hash_: str) -> bool:
    return txn.get(TABLE, bytes.fromhex(hash_)) is not None


def get(txn, hash_: str) -> BadMark | None:
    key = bytes.fromhex(hash_)
    raw = txn.get(TABLE, key)
    return None if raw is None else _decode(key, raw)


def clear(txn, hash_: str) -> bool:
    return txn.delete(TABLE, bytes.fromhex(hash_))


def uses_bad(txn, sid: bytes, length: int) -> bool:
    """Whether the chunks covering tokens [0, ``length``) of snapshot ``sid`` include a copy marked bad: a lookup
    then reports no hit, so a caller prefills and its write-behind writes fresh bytes (healing the copy) instead of
    restoring into a known failure. Costs one count while no mark exists."""
    if txn.count(TABLE) == 0:
        return False
    raw = txn.get("manifests", sid)
    if raw is None:
        return False
    m = schema.decode(raw, schema.Manifest, f"manifest {sid.hex()}")
    return any(txn.get(TABLE, bytes.fromhex(r.hash)) is not None
               for r in [*m.own, *(c for c in m.chunks if c.start < length)])


def scan(txn) -> list[BadMark]:
    return [_decode(key, raw) for key, raw in txn.range(TABLE)]


__all__ = ["BadMark", "TABLE", "clear", "get", "is_bad", "mark", "scan", "uses_bad"]
