"""The shared prefix index: the local store's boundary-hash scheme on Redis, searched in a few round trips.

Same keys as the local index (``prefix.py``): the boundary after j tokens is ``xxh3_128(nsk || int64le(t[:j]))`` at
j = 1..15 and every multiple of 16, each a sorted set whose members are the 16 tokens that follow the boundary plus
the snapshot id (lexicographic order = the local dupsort order). Every snapshot records all its boundaries, so the
number of members along a prompt's boundaries is non-increasing, and the search of ``lookup.py`` carries over:

1. the deepest recorded boundary is found by a *k-ary* search: every round probes up to ``PROBES`` boundaries with
   pipelined ``ZCARD`` (one round trip), so a 32k-token prompt (2,063 boundaries) takes about five round trips;
2. at that boundary ``ZRANGE BYLEX`` on both sides of the prompt's continuation gives the records whose predicted
   usable length ``min(boundary + matching following tokens, len(prompt) - 1)`` is largest; their summaries and
   tokens come in one more round trip and are *verified* (sealed records, tokens compared in full — never the hash);
3. if none is usable (floor above the shared prefix, untrimmable cache needing a cut) the search moves to the next
   boundary below holding more records, as locally, within a bounded number of levels and candidates.

An evicting server can remove any key, which only ever shortens what is found (a miss or a shorter hit), never
produces a wrong one: whatever is served was token-verified, and its chunks are hash-verified on fetch.
"""

from __future__ import annotations

import numpy as np
import xxhash

from ...errors import CorruptData
from ..prefix.search import LazyTokens, _matching, _Positions
from ..prefix.hashing import BLOCK_TOKENS, all_boundaries, common_prefix, continuation, level_bound
from .keys import Keys
from .records import RemoteSummary, decode_summary, decode_tokens

PROBES = 8           # boundaries probed per round trip (more cost more in redis-py per command than a round trip)
WINDOW = 16          # records read on each side of the prompt's continuation per level
MAX_LEVELS = 8       # levels scanned per lookup at most
MAX_CANDIDATES = 64  # summaries read per lookup at most
_BIG = b"\xff" * 16


def usable(p: int, s: RemoteSummary) -> bool:
    return p > 0 and p >= s.minimum_reusable_offset and (p == s.length or s.trimmable)


class RemoteLookup:
    """One lookup against the shared index (see the module docstring). ``run`` → (p, summary, sid) or None."""

    def __init__(self, client, keys: Keys, nsk: bytes, prompt: LazyTokens, block: int = BLOCK_TOKENS,
                 exclude: set[bytes] = frozenset()):
        self.client, self.keys, self.nsk, self.prompt, self.block = client, keys, nsk, prompt, block
        self.n = prompt.n
        self.pos = _Positions(self.n, block)
        self.counts: dict[int, int] = {}
        self.key_of: dict[int, str] = {}
        self._state: dict[int, xxhash.xxh3_128] = {}
        self.best: tuple[int, RemoteSummary, bytes] | None = None
        self.seen: set[bytes] = set(exclude)  # snapshot ids not to serve (this host cannot load them)
        self.examined = 0
        self.round_trips = 0

    def _key(self, i: int) -> str:
        """The boundary key of level ``i``, hashed on from the nearest level below already hashed (the streaming
        state is kept per level), so all the probes of a lookup hash the prompt about once, not once per probe."""
        key = self.key_of.get(i)
        if key is None:
            at = self.pos[i]
            below = max((j for j in self._state if j < i), default=None)
            if below is None:
                h, done = xxhash.xxh3_128(self.nsk), 0
            else:
                h, done = self._state[below].copy(), self.pos[below]
            h.update(memoryview(self.prompt.head(at))[done:at])
            self._state[i] = h
            key = self.key_of[i] = self.keys.boundary(self.nsk, h.digest())
        return key

    def _probe(self, levels) -> None:
        todo = sorted({i for i in levels if i not in self.counts})  # ascending: each hash continues the last
        if not todo:
            return
        pipe = self.client.pipeline(transaction=False)
        for i in todo:
            pipe.zcard(self._key(i))
        self.round_trips += 1
        for i, c in zip(todo, pipe.execute()):
            self.counts[i] = int(c)

    def _search(self, lo: int, hi: int, pred) -> int:
        """The largest i in [lo, hi] with pred(i) (pred(lo) holds and is monotone), k-ary, one round trip a step."""
        while lo < hi:
            span = hi - lo
            step = max(1, -(-span // PROBES))
            probes = list(range(lo + step, hi + 1, step))
            if probes[-1] != hi:
                probes.append(hi)
            self._probe(probes)
            new_lo, new_hi = lo, hi
            for i in probes:
                if pred(i):
                    new_lo = i
                else:
                    new_hi = i - 1
                    break
            lo, hi = new_lo, new_hi
        return lo

    def _deepest(self) -> int:
        last = len(self.pos) - 1
        gallop = sorted({min((1 << k) - 1, last) for k in range(last.bit_length() + 1)})
        self._probe(gallop)
        if self.counts[0] == 0:
            return -1
        lo, hi = 0, last
        for i in gallop:
            if self.counts[i] > 0:
                lo = i
            else:
                hi = i - 1
                break
        return self._search(lo, hi, lambda i: self.counts[i] > 0)

    def _bound(self, level: int) -> int:
        return level_bound(self.pos, level, self.n)

    def run(self):
        if self.n < 2:
            return None
        level = self._deepest()
        deepest, levels = level, 0
        while level >= 0 and levels < MAX_LEVELS and self.examined < MAX_CANDIDATES:
            if self.best is not None and self.best[0] >= self._bound(level):
                break
            self._scan(level, skip_equal=level < deepest)
            levels += 1
            if self.best is not None and self.best[0] >= self.pos[level]:
                break
            count = self.counts[level]
            if level == 0:
                break
            self._probe([0])
            if self.counts[0] <= count:
                break
            level = self._search(0, level - 1, lambda i, c=count: self.counts[i] > c)
        return self.best

    def _scan(self, level: int, skip_equal: bool) -> None:
        """The records nearest the prompt's continuation at ``level``: their summaries in one round trip (the
        reuse rule checked at each record's predicted length), then tokens of the viable ones, best first, until
        one is verified at a length nothing left can beat."""
        key, at = self._key(level), self.pos[level]
        query = continuation(self.prompt.head(min(self.n, at + self.block)), at, self.block)
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebylex(key, b"[" + (query + _BIG if skip_equal else query), b"+", 0, WINDOW)
        pipe.zrevrangebylex(key, b"(" + query, b"-", 0, WINDOW)
        self.round_trips += 1
        right, left = pipe.execute()
        cands = []
        for record in [*right, *left]:
            if len(record) != len(query) + 16:
                continue  # not a member we wrote
            sid = bytes(record[-16:])
            if sid in self.seen:
                continue
            self.seen.add(sid)
            predicted = min(at + _matching(record, query), self.n - 1)
            if self.best is None or predicted > self.best[0]:
                cands.append((predicted, sid))
        cands.sort(key=lambda c: -c[0])
        cands = cands[:MAX_CANDIDATES - self.examined]
        if not cands:
            return
        self.examined += len(cands)
        pipe = self.client.pipeline(transaction=False)
        for _, sid in cands:
            pipe.get(self.keys.summary(self.nsk, sid))
        pipe.get(self.keys.tokens(self.nsk, cands[0][1]))  # the likeliest answer's tokens in the same round trip
        self.round_trips += 1
        *summaries, first_tokens = pipe.execute()
        fetched = {cands[0][1]: first_tokens}
        viable = []
        for (predicted, sid), raw in zip(cands, summaries):
            try:
                s = decode_summary(raw, f"summary {sid.hex()}") if raw is not None else None
            except CorruptData:
                s = None
            if s is not None and usable(predicted, s):
                viable.append((predicted, sid, s))
        prompt = self.prompt.head(self.n)
        for at_ in range(0, len(viable), 2):
            batch = viable[at_:at_ + 2]
            if self.best is not None and batch[0][0] <= self.best[0]:
                return  # predictions only fall from here
            missing = [sid for _, sid, _ in batch if sid not in fetched]
            if missing:
                pipe = self.client.pipeline(transaction=False)
                for sid in missing:
                    pipe.get(self.keys.tokens(self.nsk, sid))
                self.round_trips += 1
                fetched.update(zip(missing, pipe.execute()))
            for predicted, sid, s in batch:
                raw = fetched[sid]
                try:
                    stored = decode_tokens(raw, f"tokens of {sid.hex()}") if raw is not None else None
                except CorruptData:
                    stored = None
                if stored is None or len(stored) != s.length:
                    continue  # evicted, dropped or damaged meanwhile
                # tokens, never the hash: the whole shared prefix is compared
                p = min(common_prefix(stored, prompt), self.n - 1)
                if not usable(p, s):
                    continue
                if self.best is None or p > self.best[0] or (p == self.best[0] and
                                                             s.created_at > self.best[1].created_at):
                    self.best = (p, s, sid)


def boundary_members(nsk: bytes, tokens: np.ndarray, sid: bytes, keys: Keys) -> list[tuple[str, bytes]]:
    """(boundary key, member) of every boundary of a snapshot's tokens."""
    return [(keys.boundary(nsk, h), cont + sid) for h, cont in all_boundaries(nsk, tokens)]


__all__ = ["RemoteLookup", "boundary_members", "usable", "PROBES"]
