"""Typed reads of index tables, so a caller gets records, not bytes to decode by hand.

What quarantine keeps: the objects a quarantined snapshot used, named in its ``quarantine`` record. Quarantine
unlinks nothing (a corrupt chunk must leave its evidence for ``verify`` and an operator). The
record ``[sid hex, reason, [object names]]`` keeps those objects out of every reclaim path — ``gc``'s orphan sweep
and the unlink after a delete or eviction (``liveness.reclaim``) — until an operator drops the record
(``Store.drop_quarantined`` or ``delete`` of the session); then ``gc`` may take what nothing else references.
"""

from __future__ import annotations

import msgspec


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


__all__ = ["quarantined_objects"]
