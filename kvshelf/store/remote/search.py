"""The shared prefix index: the local store's boundary records on Redis, read by the one search in a few round trips.

Same records as the local index (``prefix/records.py``): the boundary after j tokens is ``xxh3_128(nsk ||
int64le(t[:j]))`` at j = 1..15 and every multiple of 16, each a sorted set whose members are the 16 tokens that
follow the boundary plus the snapshot id (lexicographic order = the local dupsort order). So the search is the local
one (``prefix/search.py``); ``RedisRecords`` is its ``RecordSource`` here, shaped so that a lookup costs a few round
trips:

1. boundary counts are ``ZCARD``s, ``PROBES`` of them pipelined per round trip: a k-ary search, so a 32k-token
   prompt (2,063 boundaries) takes about five round trips to find the deepest recorded boundary;
2. at a boundary, ``ZRANGE BYLEX`` on both sides of the prompt's continuation (``WINDOW`` records each side, one
   round trip) gives the records whose predicted usable length is largest;
3. their summaries come in one more round trip, with the tokens of the likeliest candidate; the others' tokens two
   at a time, *verified* (sealed records, tokens compared — never the hash);
4. at most ``MAX_LEVELS`` boundaries and ``MAX_CANDIDATES`` summaries per lookup; snapshots this host cannot load
   (``exclude``) are never offered.

An evicting server can remove any key, which only ever shortens what is found (a miss or a shorter hit), never
produces a wrong one: whatever is served was token-verified, and its chunks are hash-verified on fetch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...errors import CorruptData
from ..prefix.hashing import all_boundaries
from ..prefix.source import REF_BYTES, Bounds
from .keys import Keys
from .records import RemoteSummary, decode_summary, decode_tokens

PROBES = 8           # boundaries probed per round trip (more cost more in redis-py per command than a round trip)
WINDOW = 16          # records read on each side of the prompt's continuation per level
MAX_LEVELS = 8       # levels scanned per lookup at most
MAX_CANDIDATES = 64  # summaries read per lookup at most


class RedisRecords:
    """The ``RecordSource`` of the shared index of namespace key ``nsk``; ``round_trips`` counts what it cost."""

    probes_per_round = PROBES
    candidates_per_round = 2 * WINDOW  # a window's candidates: one round trip for their summaries
    tokens_per_round = 2
    bounds = Bounds(levels=MAX_LEVELS, examined=MAX_CANDIDATES, steps=2 * WINDOW * MAX_LEVELS)

    def __init__(self, client, keys: Keys, nsk: bytes, exclude: set[bytes] = frozenset()):
        self.client, self.keys, self.nsk = client, keys, nsk
        self.exclude = exclude  # snapshot ids not to serve (this host cannot load them)
        self.round_trips = 0
        self._tokens: dict[bytes, bytes | None] = {}  # fetched ahead, with the summaries

    def _execute(self, pipe) -> list:
        self.round_trips += 1
        return pipe.execute()

    def counts(self, boundaries: Sequence[bytes]) -> list[int]:
        pipe = self.client.pipeline(transaction=False)
        for b in boundaries:
            pipe.zcard(self.keys.boundary(self.nsk, b))
        return [int(c) for c in self._execute(pipe)]

    def records(self, boundary: bytes, start: bytes, below: bytes) -> tuple[list[bytes], list[bytes]]:
        key = self.keys.boundary(self.nsk, boundary)
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebylex(key, b"[" + start, b"+", 0, WINDOW)
        pipe.zrevrangebylex(key, b"(" + below, b"-", 0, WINDOW)
        right, left = self._execute(pipe)
        size = len(below) + REF_BYTES  # a member we wrote: a continuation and a snapshot id
        return ([m for m in right if len(m) == size and bytes(m[-REF_BYTES:]) not in self.exclude],
                [m for m in left if len(m) == size and bytes(m[-REF_BYTES:]) not in self.exclude])

    def snapshot(self, ref: bytes) -> bytes:
        return ref  # members name their snapshot

    def summaries(self, sids: Sequence[bytes]) -> list[RemoteSummary | None]:
        """The summaries, and in the same round trip the tokens of the first (the likeliest answer)."""
        pipe = self.client.pipeline(transaction=False)
        for sid in sids:
            pipe.get(self.keys.summary(self.nsk, sid))
        pipe.get(self.keys.tokens(self.nsk, sids[0]))
        *raws, self._tokens[sids[0]] = self._execute(pipe)
        out = []
        for sid, raw in zip(sids, raws):
            try:
                out.append(decode_summary(raw, f"summary {sid.hex()}") if raw is not None else None)
            except CorruptData:
                out.append(None)
        return out

    def tokens(self, sids: Sequence[bytes]) -> list[np.ndarray | None]:
        missing = [sid for sid in sids if sid not in self._tokens]
        if missing:
            pipe = self.client.pipeline(transaction=False)
            for sid in missing:
                pipe.get(self.keys.tokens(self.nsk, sid))
            self._tokens.update(zip(missing, self._execute(pipe)))
        out = []
        for sid in sids:
            raw = self._tokens[sid]
            try:
                out.append(decode_tokens(raw, f"tokens of {sid.hex()}") if raw is not None else None)
            except CorruptData:
                out.append(None)
        return out

    def recency(self, sid: bytes, summary: RemoteSummary) -> float:
        return summary.created_at  # hosts do not publish uses: the most recently made wins a tie


def boundary_members(nsk: bytes, tokens: np.ndarray, sid: bytes, keys: Keys) -> list[tuple[str, bytes]]:
    """(boundary key, member) of every boundary of a snapshot's tokens."""
    return [(keys.boundary(nsk, h), cont + sid) for h, cont in all_boundaries(nsk, tokens)]


__all__ = ["RedisRecords", "boundary_members", "PROBES", "WINDOW", "MAX_LEVELS", "MAX_CANDIDATES"]
