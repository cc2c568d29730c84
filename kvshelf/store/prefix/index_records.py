"""``IndexRecords``: the prefix records of the store's own index, as the one search reads them (``source.py``).

Everything comes from one read transaction, so a lookup sees one consistent snapshot of the index, and every read is
a B-tree get or cursor move of about a microsecond: the search is asked for one boundary count at a time (a binary
search reads the fewest), examines one candidate at a time (reading one more than needed is the only waste) and walks
a boundary's records lazily for as long as it wants. A record's ref is its session's lineage id, which ``heads``
resolves to the session's current snapshot (``records.py``). Recency is the snapshot's last use, counting the uses
this handle remembers but has not written yet.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

import numpy as np

from ..index import schema, tables
from ..index.protocol import IndexTxn
from ..index.schema import Summary
from .source import Bounds

MAX_EXAMINED = 256    # summaries read per lookup at most
MAX_STEPS = 8192      # prefix records visited per lookup at most


class IndexRecords:
    """The ``RecordSource`` of an index read transaction ``txn``; ``touched``: sid -> unwritten last use (ns)."""

    probes_per_round = 1
    candidates_per_round = 1
    tokens_per_round = 1
    bounds = Bounds(levels=sys.maxsize, examined=MAX_EXAMINED, steps=MAX_STEPS)

    def __init__(self, txn: IndexTxn, touched: dict[bytes, int] | None = None):
        self.txn, self.touched = txn, touched or {}
        self._sessions: dict[bytes, str] = {}  # sid -> session id, so a damaged tokens record is named fully

    def counts(self, boundaries: Sequence[bytes]) -> list[int]:
        return [self.txn.dup_count("prefix", b) for b in boundaries]

    def records(self, boundary: bytes, start: bytes, below: bytes) -> tuple[Iterator[bytes], Iterator[bytes]]:
        return self.txn.dup_from("prefix", boundary, start), self.txn.dup_below("prefix", boundary, below)

    def snapshot(self, ref: bytes) -> bytes | None:
        sid = self.txn.get("heads", ref)  # the session's current snapshot (records.py)
        return None if sid is None else bytes(sid)

    def summaries(self, sids: Sequence[bytes]) -> list[Summary | None]:
        out = []
        for sid in sids:
            s = tables.summary(self.txn, sid)
            if s is not None:
                self._sessions[sid] = s.session_id
            out.append(s)
        return out

    def tokens(self, sids: Sequence[bytes]) -> list[np.ndarray | None]:
        out = []
        for sid in sids:
            raw = self.txn.get("tokens", sid)
            what = f"tokens record of snapshot {sid.hex()} (session {self._sessions.get(sid)!r})"
            out.append(None if raw is None else schema.tokens_of(raw, what))
        return out

    def recency(self, sid: bytes, summary: Summary) -> int:
        return max(summary.last_used_ns, self.touched.get(sid, 0))


__all__ = ["IndexRecords", "MAX_EXAMINED", "MAX_STEPS"]
