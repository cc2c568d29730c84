"""Typed reads of index tables, so a caller gets records, not bytes to decode by hand.

What quarantine keeps: the objects a quarantined snapshot used, named in its ``quarantine`` record. Quarantine
unlinks nothing (a corrupt chunk must leave its evidence for ``verify`` and an operator). The
record ``[sid hex, reason, [object names]]`` keeps those objects out of every reclaim path — ``gc``'s orphan sweep
and the unlink after a delete or eviction (``liveness.reclaim``) — until an operator drops the record
(``Store.drop_quarantined`` or ``delete`` of the session); then ``gc`` may take what nothing else references.
"""

from __future__ import annotations

import msgspec

from . import schema
from .keys import CHECKPOINT_MARK
from .schema import ChunkMeta, Manifest, PackMeta, Summary


def manifest(txn, sid: bytes) -> Manifest | None:
    """The snapshot's manifest record (None: not indexed; ``CorruptData`` naming it when damaged)."""
    raw = txn.get("manifests", sid)
    return None if raw is None else schema.decode(raw, Manifest, f"manifest {bytes(sid).hex()}")


def summary(txn, sid: bytes) -> Summary | None:
    """The snapshot's summary record (None: not indexed)."""
    raw = txn.get("summaries", sid)
    return None if raw is None else schema.decode(raw, Summary, f"summary {bytes(sid).hex()}")


def chunk_meta(txn, hash_: str) -> ChunkMeta | None:
    """The chunk's record: refcount, bytes, encoding, last use, location (None: not indexed)."""
    raw = txn.get("chunks", bytes.fromhex(hash_))
    return None if raw is None else schema.decode(raw, ChunkMeta, f"chunk record {hash_}")


def pack_meta(txn, pack: str) -> PackMeta | None:
    """The pack's record: live chunks and bytes, size, manifests held (None: not indexed)."""
    raw = txn.get("packs", pack.encode())
    return None if raw is None else schema.decode(raw, PackMeta, f"pack record {pack}")


def quarantined_objects(index, txn) -> set[str]:
    """Object names every quarantine record of ``index`` keeps (a record that does not decode keeps nothing)."""
    out: set[str] = set()
    for _key, raw in txn.range("quarantine"):
        try:
            rec = msgspec.msgpack.decode(raw)
            out.update(str(o) for o in (rec[2] if len(rec) > 2 else ()))
        except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError):
            continue
    return out


def orphan_checkpoint(txn, key: bytes) -> bool:
    """Whether the ``sessions`` key ``key`` is a prefix checkpoint's whose session is not indexed in ``txn`` (the one
    test, used by the checkpoint's commit, ``rebuild_index`` and ``verify``)."""
    key = bytes(key)
    at = key.find(CHECKPOINT_MARK.encode(), 32)
    return at >= 0 and txn.get("sessions", key[:at]) is None


def orphan_checkpoints(txn) -> list[bytes]:
    """Snapshot ids of indexed prefix checkpoints whose session is not indexed (``rebuild_index`` drops them)."""
    return [bytes(sid) for key, sid in txn.range("sessions") if orphan_checkpoint(txn, key)]


__all__ = ["orphan_checkpoint", "orphan_checkpoints", "chunk_meta", "manifest", "pack_meta", "quarantined_objects", "summary"]
