"""The one prefix search: the longest usable stored prefix of a prompt, over any ``RecordSource``.

Every session's current snapshot records every boundary of its tokens (``hashing.py``), with the 16 tokens that
follow the boundary in the record (records sorted by them) and a ref that the source resolves to the snapshot
(``source.py``: a lineage id in the local index, a snapshot id on Redis). Along the prompt's boundaries the number of
records is non-increasing, so:

1. the deepest boundary any snapshot shares with the prompt is found by galloping then searching on the record
   counts, ``probes_per_round`` boundaries per round (1 locally: a binary search, O(log n) gets; 8 on Redis: a k-ary
   search, one pipelined round trip a round). The prompt is hashed once: a streaming xxh3 state is kept per level
   hashed and the next one continues from the nearest below (the digests are ``hashing.boundary_hash``'s), and a
   list prompt is converted only as far as that reads;
2. at that boundary every record's *predicted* usable length is exact from the record alone: ``p = min(boundary +
   matching following tokens, len(prompt) - 1)``. Records are visited outward from the prompt's own continuation,
   so predictions only fall; a record is examined (its summary read: floor, trimmability, length, recency; then its
   tokens compared, never trusting the hash) only while its prediction can still beat the best usable one so far.
   A verified length never exceeds the prediction (tokens are compared up to it), so a candidate whose prediction
   and recency together cannot beat the best is settled from its summary without reading its tokens;
3. the search then jumps (searching on the counts again) to the next boundary below that has records the deeper
   ones did not have (only those are new there; the ones that continue the prompt a whole block further were seen
   above and are skipped in one cursor move) and stops as soon as nothing first met below can reach the best.

So an unusable snapshot at the deepest boundary (a floor above the shared prefix, an untrimmable cache that would
need a cut) never hides a usable one further down, and thousands of snapshots sharing a system prompt cost a few
cursor moves. Usable is one rule (``usable``, API.md): ``p > 0``, ``p >= floor`` and ``p == length`` unless the
caches are trimmable. Ties in length go to the highest ``source.recency`` (the local index: the most recently used,
counting this handle's unwritten uses; Redis: the most recently made) among the first ``TIE_CANDIDATES`` equal ones
examined. (Where the Redis side's choice changed: its own search kept the first equal candidate its window
offered unless a later one was verified in the same round trip of two, and never scanned a level for a tie alone;
now the most recently made equal one wins, which costs one more round trip when it is not the candidate whose tokens
came with the summaries.) Work is bounded by the source (``Bounds``: levels, summaries, records visited): only a
store built to defeat it (hundreds of unusable snapshots predicted longer than the answer) can exhaust that, and then
the best found so far is returned.

``PrefixSearch(source, nsk, prompt, block).run()`` is the entry: the store's façade runs it over
``IndexRecords`` (``index_records.py``) in one read transaction, the shared tier over ``RedisRecords``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from .hashing import BLOCK_TOKENS, common_prefix, continuation, level_bound, tokens_array
from .source import REF_BYTES, RecordSource, Summary

TIE_CANDIDATES = 32   # equal-length usable candidates compared for recency
_PAD = b"\xff" * 8
_BIG = b"\xff" * 16   # sorts after every ref: skips the records equal to the query in one move


class LazyTokens:
    """A prompt whose int64 form is made on demand: a Python list is converted only as far as it is read."""

    def __init__(self, tokens: Sequence[int] | np.ndarray, what: str = "tokens"):
        self.what = what
        if isinstance(tokens, (list, tuple)):
            self._src: Sequence[int] | None = tokens
            self._arr = np.zeros(0, dtype="<i8")
            self.n = len(tokens)
        else:
            self._src = None
            self._arr = tokens_array(tokens, what)
            self.n = len(self._arr)

    def head(self, k: int) -> np.ndarray:
        """At least the first ``min(k, n)`` tokens as int64 (checked as they are converted)."""
        if self._src is not None and len(self._arr) < min(k, self.n):
            done = len(self._arr)
            k = min(self.n, max(k, 4 * done, 256))
            try:  # array('q') converts Python ints exactly (floats refused) and faster than numpy; only the new part
                more = np.frombuffer(array("q", self._src[done:k]), dtype=np.int64).astype("<i8", copy=False)
                if more.size and more.min() < 0:
                    raise ValueError
            except (TypeError, ValueError, OverflowError):
                more = tokens_array(self._src[:k], self.what)[done:]  # raises the precise error
            self._arr = np.concatenate([self._arr, more]) if done else more
            if k == self.n:
                self._src = None
        return self._arr


class Found(NamedTuple):
    """A lookup's answer: the usable length, the snapshot's summary and id, and the (length, recency) it won by."""

    length: int
    summary: Any
    sid: bytes
    rank: tuple


class _Positions:
    """``hashing.positions(n, block)`` without building the list (a 32k prompt has 2,000 boundaries)."""

    def __init__(self, n: int, block: int):
        self.n, self.block = n, block
        self.small = min(n, block - 1)
        self.len = self.small + n // block

    def __len__(self) -> int:
        return self.len

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.len:
            raise IndexError(i)
        return i + 1 if i < self.small else (i - self.small + 1) * self.block


def _matching(record: bytes | memoryview, query: bytes) -> int:
    """How many leading tokens of a record's continuation equal the query's (padding never matches)."""
    for i in range(0, len(query), 8):
        chunk = record[i:i + 8]
        if chunk != query[i:i + 8] or chunk == _PAD:
            return i // 8
    return len(query) // 8


def usable(p: int, s: Summary) -> bool:
    """API.md's rule: a snapshot gives ``p`` tokens iff ``p > 0``, ``p >= `` its floor, and ``p`` is its whole
    length unless its caches can be cut."""
    return p > 0 and p >= s.minimum_reusable_offset and (p == s.length or s.trimmable)


class _Candidate(NamedTuple):
    predicted: int
    sid: bytes
    summary: Any
    recency: float


class PrefixSearch:
    """One lookup over one ``RecordSource`` (see the module docstring). ``run`` → ``Found`` or None."""

    def __init__(self, source: RecordSource, nsk: bytes, prompt: LazyTokens, block: int = BLOCK_TOKENS):
        self.source, self.nsk, self.prompt, self.block = source, nsk, prompt, block
        self.bounds = source.bounds
        self.k = max(1, source.probes_per_round)
        self.n = prompt.n
        self.pos = _Positions(self.n, block)
        self.keys: dict[int, bytes] = {}
        self.states: dict[int, Any] = {}  # level -> the streaming hash after pos[level] tokens
        self.hashed: list[int] = []       # the levels in ``states``, ascending
        self.counts: dict[int, int] = {}
        self.best: Found | None = None
        self.seen: set[bytes] = set()
        self.examined = self.steps = self.ties = 0

    # --- records per boundary -------------------------------------------------------------------------------------
    def _key(self, i: int) -> bytes:
        """Level ``i``'s boundary hash, hashed on from the nearest level below already hashed, so all the probes of
        a lookup hash the prompt about once, not once per probe."""
        key = self.keys.get(i)
        if key is None:
            at, where = self.pos[i], bisect_left(self.hashed, i)
            if where == 0:
                h, done = xxhash.xxh3_128(self.nsk), 0
            else:
                below = self.hashed[where - 1]
                h, done = self.states[below].copy(), self.pos[below]
            h.update(memoryview(self.prompt.head(at))[done:at])
            self.states[i] = h
            self.hashed.insert(where, i)
            key = self.keys[i] = h.digest()
        return key

    def _probe(self, levels: list[int]) -> None:
        """Count the records of ``levels`` (ascending, so each hash continues the last) not counted yet: one round."""
        if len(levels) == 1:  # a source that answers one per round: the lean path (a binary search's every step)
            if levels[0] not in self.counts:
                self.counts[levels[0]] = self.source.counts([self._key(levels[0])])[0]
            return
        todo = [i for i in levels if i not in self.counts]
        if todo:
            self.counts.update(zip(todo, self.source.counts([self._key(i) for i in todo])))

    def _largest(self, lo: int, hi: int, above: int) -> int:
        """The largest i in [lo, hi] with more than ``above`` records (lo has; counts fall as i grows). One probe a
        round: a binary search. ``k`` a round: evenly spaced, the top of the range among them (a whole prompt
        stored, or the level right below holding new records, are common answers)."""
        while lo < hi:
            if self.k == 1:
                probes = [(lo + hi + 1) // 2]
            else:
                step = -(-(hi - lo) // self.k)
                probes = sorted({*range(lo + step, hi + 1, step), hi})
            self._probe(probes)
            for i in probes:
                if self.counts[i] > above:
                    lo = i
                else:
                    hi = i - 1
                    break
        return lo

    def _deepest(self) -> int:
        """Index of the deepest boundary of the prompt that some snapshot records (-1: none). Gallops first (levels
        2^j - 1 and the last), so a shallow match never converts or hashes the whole prompt and a miss is one
        round: one level at a time for a source that answers one per round (stopping at the first empty one), all
        of them in one round for a source that batches (they are only log2 n + 2)."""
        last = len(self.pos) - 1
        gallop = [(1 << j) - 1 for j in range(last.bit_length()) if (1 << j) - 1 < last] + [last]
        per = 1 if self.k == 1 else len(gallop)
        lo, hi = -1, last  # invariant: lo recorded (or -1: none known); beyond hi not
        for r in range(0, len(gallop), per):
            self._probe(gallop[r:r + per])
            for i in gallop[r:r + per]:
                if self.counts[i] > 0:
                    lo = i
                else:
                    hi = i - 1
                    break
            if hi < last or lo == last:
                break
        if lo < 0:
            return -1
        return self._largest(lo, hi, 0)

    def _next_level(self, level: int, count: int) -> int:
        """The deepest boundary below ``level`` holding more records than ``count`` (-1: none)."""
        if level == 0:
            return -1
        self._probe([0])
        if self.counts[0] <= count:
            return -1
        return self._largest(0, level - 1, count)

    # --- the search -----------------------------------------------------------------------------------------------
    def run(self) -> Found | None:
        if self.n < 2:
            return None
        level = self._deepest()
        deepest, scanned = level, 0
        while level >= 0 and scanned < self.bounds.levels:
            bound = level_bound(self.pos, level, self.n)
            if self.best is not None and (self.best.length > bound or
                                          (self.best.length == bound and self.ties >= TIE_CANDIDATES)):
                break
            scanned += 1
            if not self._scan(level, skip_equal=level < deepest):
                break
            if self.best is not None and self.best.length >= self.pos[level]:
                break  # anything first met below shares fewer than pos[level] tokens
            level = self._next_level(level, self.counts[level])
        return self.best

    def _may_beat(self, predicted: int) -> bool:
        return self.best is None or predicted > self.best.length or (
            predicted == self.best.length and self.ties < TIE_CANDIDATES)

    def _scan(self, level: int, skip_equal: bool) -> bool:
        """Visit the records at ``level`` outward from the prompt's continuation, examining the new ones in the
        source's batches. False: the work budget is spent."""
        at = self.pos[level]
        query = continuation(self.prompt.head(min(self.n, at + self.block)), at, self.block)
        right, left = self.source.records(self._key(level), query + _BIG if skip_equal else query, query)
        right, left = iter(right), iter(left)
        r, l_ = next(right, None), next(left, None)
        rm = _matching(r, query) if r is not None else -1
        lm = _matching(l_, query) if l_ is not None else -1
        batch: list[tuple[int, bytes]] = []
        while r is not None or l_ is not None:
            self.steps += 1
            if self.steps > self.bounds.steps:
                self._examine(batch)
                return False
            if rm >= lm:
                record, matched = r, rm
                r = next(right, None)
                rm = _matching(r, query) if r is not None else -1
            else:
                record, matched = l_, lm
                l_ = next(left, None)
                lm = _matching(l_, query) if l_ is not None else -1
            predicted = min(at + matched, self.n - 1)
            if not self._may_beat(predicted):
                break  # everything further out predicts no more than this
            ref = bytes(record[-REF_BYTES:])
            if ref in self.seen:
                continue
            self.seen.add(ref)
            self.examined += 1
            if self.examined > self.bounds.examined:
                self._examine(batch)
                return False
            batch.append((predicted, ref))
            if len(batch) >= self.source.candidates_per_round:
                self._examine(batch)
                batch = []
        if batch:
            self._examine(batch)
        return True

    def _examine(self, batch: list[tuple[int, bytes]]) -> None:
        """Read the batch's summaries (one round), keep those usable at their prediction, then verify their tokens
        best first (``tokens_per_round`` a round) while one can still beat the best."""
        source = self.source
        found = []
        for predicted, ref in batch:
            sid = source.snapshot(ref)
            if sid is not None:
                found.append((predicted, sid))
        if not found:
            return
        viable = [_Candidate(predicted, sid, s, source.recency(sid, s))
                  for (predicted, sid), s in zip(found, source.summaries([sid for _, sid in found]))
                  if s is not None and usable(predicted, s)]
        if len(viable) > 1:
            viable.sort(key=lambda c: (c.predicted, c.recency), reverse=True)
        per = max(1, source.tokens_per_round)
        at = 0
        while at < len(viable):
            group = []
            while at < len(viable) and len(group) < per:
                c = viable[at]
                at += 1
                if self.best is not None and c.predicted == self.best.length:
                    self.ties += 1  # an equal one: the best already holds its length
                if self.best is None or (c.predicted, c.recency) > self.best.rank:
                    group.append(c)
            if not group:
                continue
            for c, stored in zip(group, source.tokens([c.sid for c in group])):
                self._verify(c, stored)

    def _verify(self, c: _Candidate, stored: np.ndarray | None) -> None:
        if stored is None or len(stored) != c.summary.length:
            return  # gone, replaced or damaged meanwhile
        if self.best is not None and (c.predicted, c.recency) <= self.best.rank:
            return
        # tokens, never the hash: the whole predicted prefix is compared (a match never reaches past the record)
        p = common_prefix(stored[:c.predicted], self.prompt.head(c.predicted)[:c.predicted])
        if not usable(p, c.summary):
            return
        rank = (p, c.recency)
        if self.best is None or p > self.best.length:
            self.ties = 0
        if self.best is None or rank > self.best.rank:
            self.best = Found(p, c.summary, c.sid, rank)


__all__ = ["Found", "LazyTokens", "PrefixSearch", "TIE_CANDIDATES", "usable"]
