"""``RecordSource``: what the one prefix search (``search.py``) needs from wherever prefix records live.

Why a seam: the search itself — find the deepest boundary the prompt shares with any snapshot, visit that boundary's
records outward from the prompt's continuation, verify candidates by their tokens, step down to the next boundary
with new records — is the same whether the records sit in the local index (``index_records.IndexRecords``: one read
transaction, gets cost a microsecond) or on a shared Redis server (``remote.search.RedisRecords``: every request is
a network round trip). What differs is only where the records come from and how much a source wants to be asked at
once, so that is all a source states:

* ``probes_per_round``: boundary counts the source answers together (1 for the local index: a binary search reads
  the fewest; 8 for Redis: a k-ary search with one pipelined round trip per round);
* ``candidates_per_round`` / ``tokens_per_round``: how many candidates' summaries / tokens are read together (1 for
  the local index, where reading one more than needed is the only waste; a whole window's summaries and two
  candidates' tokens per round trip for Redis);
* ``bounds``: the work a lookup may do (levels scanned, summaries read, records visited) before it settles for the
  best found so far.

A prefix record is the 16 tokens that follow a boundary (big-endian int64, 0xff-padded: ``hashing.continuation``)
followed by a 16-byte *ref*: a lineage id locally (``records.py``), a snapshot id on Redis. ``snapshot(ref)``
resolves it. Records of one boundary are in lexicographic order, so the ones continuing most like the prompt are
neighbours of its continuation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

REF_BYTES = 16  # a record ends in the 16-byte ref it names its snapshot by


@dataclass(frozen=True)
class Bounds:
    """The most work one lookup does; past it, the best found so far is the answer."""

    levels: int     # boundaries whose records are scanned
    examined: int   # candidates whose summaries are read
    steps: int      # records visited


class Summary(Protocol):
    """What the search reads about a candidate before its tokens (the local ``Summary`` and ``RemoteSummary``)."""

    session_id: str
    namespace: str
    length: int
    minimum_reusable_offset: int
    trimmable: bool


@runtime_checkable
class RecordSource(Protocol):
    probes_per_round: int
    candidates_per_round: int
    tokens_per_round: int
    bounds: Bounds

    def counts(self, boundaries: Sequence[bytes]) -> list[int]:
        """The number of records under each boundary hash (``hashing.boundary_hash``), in one round."""
        ...

    def records(self, boundary: bytes, start: bytes, below: bytes) -> tuple[Iterable[bytes], Iterable[bytes]]:
        """The records of ``boundary`` ``>= start`` ascending and ``< below`` descending: as many as the source
        wants to offer (the local index: all of them, lazily; Redis: a window each side, in one round trip)."""
        ...

    def snapshot(self, ref: bytes) -> bytes | None:
        """The snapshot id a record's ref names now (None: none, or one this source will not serve)."""
        ...

    def summaries(self, sids: Sequence[bytes]) -> list[Summary | None]:
        """The candidates' summaries, in one round (None: gone or unreadable)."""
        ...

    def tokens(self, sids: Sequence[bytes]) -> list[np.ndarray | None]:
        """The candidates' stored tokens, in one round (None: gone or unreadable)."""
        ...

    def recency(self, sid: bytes, summary: Summary) -> float:
        """Ties in length go to the highest: when the snapshot was last used (or made, where uses are not kept)."""
        ...


__all__ = ["Bounds", "RecordSource", "REF_BYTES", "Summary"]
