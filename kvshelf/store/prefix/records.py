"""Prefix records kept per session lineage, so a re-save of a grown session writes only its new boundaries.

Why: the ``prefix`` table once tagged each record with the snapshot id, so every save of a session
deleted all ~T/16 records of the snapshot it replaced and wrote all of the new one's: a chat saved after every turn
cost O(T) index writes per save, O(T^2) over the chat. A record now ends in the session's *lineage id* — 16 bytes
naming its (identity, namespace, session) key, the same for every save of that session — and the plain ``heads``
table maps a lineage id to the session's current snapshot id. A record that means the same thing before and after a
save is then byte-identical, so it stays where it is:

* The record of boundary p of tokens t is ``hash(nsk, t[:p]) -> continuation(t, p) + lineage``. For the replaced
  tokens O and the new tokens N with common prefix c, every p <= c - block has the same key and continuation in both
  (and is a boundary of both), so only the tails p > max(0, c - block) are compared: the old tail's records missing
  from the new tail are deleted, the new tail's missing from the old written. Growing by k tokens changes about
  k/16 + 2 records; an identical re-save none; a rewritten last window, a trim-and-regrow, the short boundaries
  1..15 and the 0xff-padded continuations near the old end all fall out of that one set difference.
* The table holds exactly the records of each head's tokens — never of a stale or dropped snapshot. Every path that
  removes a session's current snapshot (delete, eviction, quarantine: all through ``ledger.drop``) deletes its
  records and its head, so ``verify`` demands equality with what the heads imply. (Dropping only the head and letting
  lookups skip orphaned records was the alternative; it leaves O(T) dead records per deleted session that nothing
  collects, and the counts could no longer be checked.)

Why a hash of the session key and not the key itself: dupsort values are capped at LMDB's 511-byte key size, and a
session key is up to 480 bytes before the 128-byte continuation. BLAKE2b rather than xxh3: session ids are chosen by
clients, and two colliding lineages would share — and delete — each other's records (a lookup would only miss, as
tokens are always compared, but one tenant could hide another's prefixes). It is computed once per commit or drop,
never per record a lookup visits.

``counting()`` is the seam that counts a thread's record writes and deletes (tests count work, never time).
"""

from __future__ import annotations

import numpy as np

from ...errors import CorruptData, IncompatibleFormat
from ..index import schema
from ..index.keys import lineage_id
from ..index.schema import Manifest
from .hashing import BLOCK_TOKENS, boundaries_after, common_prefix
from ..base.tally import ThreadTally

_EMPTY = np.zeros(0, dtype="<i8")
Record = tuple[bytes, bytes]  # (boundary hash, continuation + lineage id)


def records_after(nsk: bytes, lineage: bytes, tokens: np.ndarray, after: int = 0,
                  block: int = BLOCK_TOKENS) -> list[Record]:
    """The records of ``tokens`` at boundary positions > ``after`` (0: all of them)."""
    return [(key, cont + lineage) for key, cont in boundaries_after(nsk, tokens, after, block)]


def changed(nsk: bytes, lineage: bytes, old: np.ndarray, new: np.ndarray,
            block: int = BLOCK_TOKENS) -> tuple[list[Record], list[Record]]:
    """(records to delete, records to write) when a session's tokens go from ``old`` to ``new``."""
    cut = max(0, common_prefix(old, new) - block)  # positions <= cut: same key, same continuation in both
    old_tail = records_after(nsk, lineage, old, cut, block)
    new_tail = records_after(nsk, lineage, new, cut, block)
    olds, news = set(old_tail), set(new_tail)
    return [r for r in old_tail if r not in news], [r for r in new_tail if r not in olds]


# --- the counting seam ----------------------------------------------------------------------------------------------
_TALLY = ThreadTally("put", "delete", "head")
counting = _TALLY.counting  # counts this thread's prefix-record puts and deletes (and head moves) while a block runs
_count = _TALLY.count


def _put(txn, records: list[Record]) -> None:
    _count("put", len(records))
    for key, value in records:
        txn.dup_add("prefix", key, value)


def _delete(txn, records: list[Record]) -> None:
    _count("delete", len(records))
    for key, value in records:
        txn.dup_remove("prefix", key, value)


# --- the table operations the ledger uses ---------------------------------------------------------------------------
def snapshot_tokens(txn, sid: bytes) -> np.ndarray | None:
    """A snapshot's tokens: its tokens record (checksum checked), else its manifest's; None when neither reads."""
    raw = txn.get("tokens", sid)
    if raw is not None:
        try:
            return schema.tokens_of(raw, f"tokens record of snapshot {sid.hex()}")
        except CorruptData:
            pass
    raw = txn.get("manifests", sid)
    if raw is None:
        return None
    try:
        return np.asarray(schema.decode(raw, Manifest, f"manifest {sid.hex()}").tokens, dtype="<i8")
    except (CorruptData, IncompatibleFormat):
        return None


def move_head(txn, session_key: bytes, sid: bytes, tokens: np.ndarray, block: int = BLOCK_TOKENS) -> None:
    """The session's current snapshot becomes ``sid`` (tokens ``tokens``): only the records that differ from the
    previous head's are deleted / written. Runs before the previous snapshot's tokens record is dropped. A previous
    head whose tokens no longer read leaves its records behind (``verify`` reports them; ``rebuild_index`` clears)."""
    lineage, nsk = lineage_id(session_key), session_key[16:32]
    old = txn.get("heads", lineage)
    old_tokens = _EMPTY if old is None else snapshot_tokens(txn, bytes(old))
    gone, new = changed(nsk, lineage, _EMPTY if old_tokens is None else old_tokens, tokens, block)
    _delete(txn, gone)
    _put(txn, new)
    if old is None or bytes(old) != sid:
        _count("head")
        txn.put("heads", lineage, sid)


def drop_head(txn, session_key: bytes, sid: bytes, tokens: np.ndarray, block: int = BLOCK_TOKENS) -> None:
    """``sid`` leaves the index for good (delete, eviction, quarantine): if it is its session's head, its records and
    the head go (a snapshot that is not the head has no records)."""
    lineage = lineage_id(session_key)
    if txn.get("heads", lineage) != sid:
        return
    _delete(txn, records_after(session_key[16:32], lineage, tokens, 0, block))
    _count("head")
    txn.delete("heads", lineage)


def rebuild_table(txn, block: int = BLOCK_TOKENS) -> int:
    """Refill ``prefix`` and ``heads`` from ``sessions`` and ``tokens`` (an older index format, migrated in the
    caller's one write transaction). A session whose tokens do not read gets no records (``verify`` reports it).
    Returns the records written."""
    txn.clear("prefix")
    txn.clear("heads")
    written = 0
    for skey, sid in txn.range("sessions"):
        skey, sid = bytes(skey), bytes(sid)
        tokens = snapshot_tokens(txn, sid)
        if tokens is None:
            continue
        lineage = lineage_id(skey)
        recs = records_after(skey[16:32], lineage, tokens, 0, block)
        _put(txn, recs)
        txn.put("heads", lineage, sid)
        written += len(recs)
    return written


# --- what verify checks ---------------------------------------------------------------------------------------------
def check_head(txn, session_key: bytes, sid: bytes, tokens: np.ndarray,
               block: int = BLOCK_TOKENS) -> tuple[int, list[str]]:
    """For a session's current snapshot: (records it implies, what is wrong with its head or its records)."""
    lineage = lineage_id(session_key)
    problems = []
    if txn.get("heads", lineage) != sid:
        problems.append("its session's prefix head points elsewhere")
    recs = records_after(session_key[16:32], lineage, tokens, 0, block)
    missing = sum(1 for key, value in recs if not txn.dup_has("prefix", key, value))
    if missing:
        problems.append(f"{missing} of {len(recs)} prefix records missing")
    return len(recs), problems


def check_heads(txn, heads_expected: int, manifests: set[bytes]) -> list[str]:
    """The ``heads`` table against the sessions verify walked: one head per session, each naming an indexed
    snapshot."""
    problems = []
    n = txn.count("heads")
    if n != heads_expected:
        problems.append(f"{n} prefix heads for {heads_expected} sessions")
    for lineage, sid in txn.range("heads"):
        if bytes(sid) not in manifests:
            problems.append(f"head {bytes(lineage).hex()} names no indexed snapshot ({bytes(sid).hex()})")
    return problems


__all__ = ["Record", "changed", "check_head", "check_heads", "counting", "drop_head", "lineage_id", "move_head",
           "rebuild_table", "records_after", "snapshot_tokens"]
