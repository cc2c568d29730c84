"""The prefix search behind ``Store.lookup``: the longest usable stored prefix of a prompt, exactly.

Every session's current snapshot records every boundary of its tokens (``prefix.py``), with the 16 tokens that follow
the boundary in the record (dups sorted by them) and the session's lineage id, which ``heads`` resolves to the
snapshot (``records.py``). Along the prompt's boundaries the number of records is non-increasing, so:

1. the deepest boundary any snapshot shares with the prompt is found by galloping then binary search (O(log n) gets;
   a list prompt is converted only as far as that reads);
2. at that boundary every record's *predicted* usable length is exact from the record alone: ``p = min(boundary +
   matching following tokens, len(prompt) - 1)``. Records are visited outward from the prompt's own continuation,
   so predictions only fall; a record is examined (summary read: floor, trimmability, length; then its tokens are
   compared, never trusting the hash) only while its prediction can still beat the best usable one so far;
3. the search then jumps (binary search on the record counts) to the next boundary below that has records the deeper
   ones did not have (only those are new there; the ones that continue the prompt a whole block further were seen
   above and are skipped in one cursor move) and stops as soon as nothing first met below can reach the best.

So an unusable snapshot at the deepest boundary (a floor above the shared prefix, an untrimmable cache that would
need a cut) never hides a usable one further down, and thousands of snapshots sharing a system prompt cost a few
cursor moves. Ties in length go to the most recently used among the first ``TIE_CANDIDATES`` equal ones examined.
Work is bounded (``MAX_EXAMINED`` summaries, ``MAX_STEPS`` records visited): only a store built to defeat it (hundreds
of unusable snapshots predicted longer than the answer) can exhaust that, and then the best found so far is returned.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
import numpy as np

from ..index import schema as mf
from ..index.schema import Summary
from .hashing import boundary_hash, common_prefix, continuation, level_bound, tokens_array


TIE_CANDIDATES = 32   # equal-length usable candidates compared for recency
MAX_EXAMINED = 256    # summaries read per lookup at most
MAX_STEPS = 8192      # prefix records visited per lookup at most
_PAD = b"\xff" * 8
_BIG = b"\xff" * 16   # sorts after every sid: skips the records equal to the query in one move


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


class _Positions:
    """``prefix.positions(n, block)`` without building the list (a 32k prompt has 2,000 boundaries)."""

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


class _Lookup:
    """One lookup in one read transaction (see the module docstring)."""

    def __init__(self, store, txn, nsk: bytes, prompt: LazyTokens):
        self.store, self.txn, self.nsk, self.prompt = store, txn, nsk, prompt
        self.block = store.block
        self.touched = store._touched()  # uses this handle remembers but has not written yet
        self.n = prompt.n
        self.pos = _Positions(self.n, self.block)
        self.keys: dict[int, bytes] = {}
        self.counts: dict[int, int] = {}
        self.best: tuple | None = None   # (p, summary, sid, rank)
        self.seen: set[bytes] = set()
        self.examined = self.steps = self.ties = 0

    # --- records per boundary -------------------------------------------------------------------------------------
    def _key(self, i: int) -> bytes:
        key = self.keys.get(i)
        if key is None:
            key = self.keys[i] = boundary_hash(self.nsk, self.prompt.head(self.pos[i]), self.pos[i])
        return key

    def _count(self, i: int) -> int:
        count = self.counts.get(i)
        if count is None:
            count = self.counts[i] = self.txn.dup_count("prefix", self._key(i))
        return count

    def _deepest(self) -> int:
        """Index of the deepest boundary of the prompt that some snapshot records (-1: none)."""
        if self._count(0) == 0:
            return -1
        lo, step = 0, 1
        hi = len(self.pos) - 1  # invariant: pos[lo] recorded; beyond hi not
        while lo + step <= hi:   # gallop, so a shallow match never converts the whole prompt
            if self._count(lo + step) == 0:
                hi = lo + step - 1
                break
            lo += step
            step *= 2
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._count(mid) > 0:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _next_level(self, level: int, count: int) -> int:
        """The deepest boundary below ``level`` holding more records than ``count`` (-1: none)."""
        if level == 0 or self._count(0) <= count:
            return -1
        lo, hi = 0, level - 1  # invariant: count(lo) > count
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._count(mid) > count:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _bound(self, level: int) -> int:
        return level_bound(self.pos, level, self.n)

    # --- the search -----------------------------------------------------------------------------------------------
    def run(self):
        if self.n < 2:
            return None
        level = self._deepest()
        deepest = level
        while level >= 0:
            if self.best is not None and (self.best[0] > self._bound(level) or
                                          (self.best[0] == self._bound(level) and self.ties >= TIE_CANDIDATES)):
                break
            if not self._scan(level, skip_equal=level < deepest):
                break
            if self.best is not None and self.best[0] >= self.pos[level]:
                break  # anything first met below shares fewer than pos[level] tokens
            level = self._next_level(level, self._count(level))
        return self.best

    def _scan(self, level: int, skip_equal: bool) -> bool:
        """Visit the records at ``level`` outward from the prompt's continuation. False: the work budget is spent."""
        key, at = self._key(level), self.pos[level]
        query = continuation(self.prompt.head(min(self.n, at + self.block)), at, self.block)
        right = self.txn.dup_from("prefix", key, query + _BIG if skip_equal else query)
        left = self.txn.dup_below("prefix", key, query)
        r, l_ = next(right, None), next(left, None)
        rm = _matching(r, query) if r is not None else -1
        lm = _matching(l_, query) if l_ is not None else -1
        while r is not None or l_ is not None:
            self.steps += 1
            if self.steps > MAX_STEPS:
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
            if self.best is not None and (predicted < self.best[0] or
                                          (predicted == self.best[0] and self.ties >= TIE_CANDIDATES)):
                return True  # everything further out predicts no more than this
            lineage = bytes(record[-16:])
            if lineage in self.seen:
                continue
            self.seen.add(lineage)
            self.examined += 1
            if self.examined > MAX_EXAMINED:
                return False
            sid = self.txn.get("heads", lineage)  # the session's current snapshot (records.py)
            if sid is not None:
                self._consider(bytes(sid), predicted, at + self.block + 1)
        return True

    def _consider(self, sid: bytes, predicted: int, reach: int) -> None:
        raw = self.txn.get("summaries", sid)
        if raw is None:
            return
        s = mf.decode(raw, Summary, f"summary {sid.hex()}")
        if not _usable(predicted, s):
            return
        toks = self.txn.get("tokens", sid)
        if toks is None:
            return
        stored = mf.tokens_of(toks, f"tokens record of snapshot {sid.hex()} (session {s.session_id!r})")
        # tokens, not hashes: the whole shared prefix is compared (a match never reaches past the next boundary)
        p = min(common_prefix(stored, self.prompt.head(min(self.n, reach))[:reach]), self.n - 1)
        if not _usable(p, s):
            return
        rank = (p, max(s.last_used_ns, self.touched.get(sid, 0)))
        if self.best is not None and p == self.best[0]:
            self.ties += 1
        elif self.best is None or p > self.best[0]:
            self.ties = 0
        if self.best is None or rank > self.best[3]:
            self.best = (p, s, sid, rank)


def _usable(p: int, s: Summary) -> bool:
    return p > 0 and p >= s.minimum_reusable_offset and (p == s.length or s.trimmable)


__all__ = ["LazyTokens", "TIE_CANDIDATES", "MAX_EXAMINED", "MAX_STEPS"]
