"""Pins: sessions the budget and the LRU never evict (a system prompt an operator wants warm for months).

Why a collaborator of its own: a pin is a promise about space, so it lives beside the budget (``budget.py`` asks
``protects`` before it picks a victim) but it is its own record, the ``pins`` table of the index: key = the
session key (identity, namespace, session id), value = ``[pinned_at_ns, ttl_ns]`` (``ttl_ns`` 0: no expiry). A pin
follows the session, not one snapshot: a session saved again stays pinned.

TTL: a pin expires ``ttl`` after the later of its pinning and the session's last use. The last use is the one the
LRU already keeps (``Summary.last_used_ns``, written by every restore's touch), so a hit refreshes the TTL without a
write of its own. An expired pin protects nothing; its record is dropped the next time eviction meets it, and a
delete, an eviction or a quarantine of the session drops its pin (``forget``).

Limit: pins may hold at most ``max_pinned_bytes`` (the bytes of the pinned sessions' current snapshots; default half
the store's ``max_bytes``, none without a budget). A pin beyond it is refused with ``PinLimitExceeded`` and changes
nothing, so a budget can never be filled by pins alone.

Clock: "now" is the ``clock`` the store was given (seconds since the epoch, default ``time.time``), so a TTL can be
checked without waiting it out (the tests advance a fake clock). The last uses it is compared with are the LRU's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec

from ...errors import InvalidCacheState, KvShelfError, SnapshotNotFound
from ..identity import namespace_key
from ..index import keys, tables
from ..context import StoreContext
from ..index.schema import Summary

TABLE = "pins"


class PinLimitExceeded(KvShelfError):
    """A pin would make the pinned sessions hold more than ``max_pinned_bytes``; nothing was pinned."""


@dataclass(frozen=True)
class PinInfo:
    """One pinned session: its scope, the bytes of its current snapshot, and when the pin expires (None: never)."""

    session_id: str
    namespace: str
    session_key: bytes
    nbytes: int
    expires_at: float | None


def _decode(raw: bytes) -> tuple[int, int]:
    try:
        pinned_at, ttl = msgspec.msgpack.decode(raw)
        return int(pinned_at), int(ttl)
    except (msgspec.DecodeError, ValueError, TypeError):
        return 0, 0  # a damaged pin record still protects (losing a pin is worse than keeping a session)


def _expires_ns(pinned_at: int, ttl: int, last_used_ns: int) -> int | None:
    return None if ttl <= 0 else max(pinned_at, last_used_ns) + ttl


class Pins:
    """The pins of one store handle, over its context (``ctx.index``, ``ctx.id_key`` — None for an identity-blind
    admin handle: pins then name a session in every identity that has it —, ``ctx.max_bytes``, ``ctx.root``) and
    a ``clock`` (seconds; None: ``time.time``)."""

    def __init__(self, ctx: StoreContext, clock: Callable[[], float] | None = None):
        self.ctx = ctx
        self.clock = clock or time.time
        self.max_pinned_bytes: int | None = None  # explicit limit; None: half the budget

    def _now_ns(self) -> int:
        return int(self.clock() * 1e9)

    @property
    def index(self):  # read through: an offline job may replace the index of an open handle
        return self.ctx.index

    # ------------------------------------------------------------------ limit
    def limit(self) -> int | None:
        if self.max_pinned_bytes is not None:
            return self.max_pinned_bytes
        budget = self.ctx.max_bytes
        return None if budget is None else budget // 2

    def set_limit(self, max_pinned_bytes: int | None) -> None:
        if max_pinned_bytes is not None and (not isinstance(max_pinned_bytes, int) or max_pinned_bytes < 0):
            raise InvalidCacheState(f"max_pinned_bytes must be an int >= 0 or None, got {max_pinned_bytes!r}")
        self.max_pinned_bytes = max_pinned_bytes

    # ------------------------------------------------------------------ records
    def _session_keys(self, txn, session_id: str, namespace: str) -> list[bytes]:
        if self.ctx.id_key is not None:
            return [keys.session_key(self.ctx.id_key, namespace_key(self.ctx.id_key, namespace), session_id)]
        tail = session_id.encode("utf-8", "surrogatepass")
        out = []
        for key, sid in txn.range("sessions"):
            if bytes(key[32:]) != tail:
                continue
            s = self._summary(txn, bytes(sid))
            if s is not None and s.namespace == namespace:
                out.append(bytes(key))
        return out

    @staticmethod
    def _summary(txn, sid: bytes) -> Summary | None:
        return tables.summary(txn, sid)

    def _current(self, txn, skey: bytes) -> Summary | None:
        sid = txn.get("sessions", skey)
        return None if sid is None else self._summary(txn, bytes(sid))

    def _live(self, txn, now_ns: int) -> Iterator[tuple[bytes, Summary | None, int | None]]:
        """Every unexpired pin: (session key, its current summary or None, expiry ns or None)."""
        for skey, raw in txn.range(TABLE):
            pinned_at, ttl = _decode(bytes(raw))
            s = self._current(txn, bytes(skey))
            expires = _expires_ns(pinned_at, ttl, s.last_used_ns if s is not None else 0)
            if expires is not None and expires <= now_ns:
                continue
            yield bytes(skey), s, expires

    # ------------------------------------------------------------------ operations
    def pin(self, session_id: str, namespace: str = "", ttl: float | None = None) -> list[PinInfo]:
        """Pin the session (every identity's, on an identity-blind handle). ``ttl`` seconds (None: no expiry)."""
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise InvalidCacheState(f"a pin's ttl must be a number of seconds > 0 or None, got {ttl!r}")
        ttl_ns = 0 if ttl is None else int(ttl * 1e9)
        now = self._now_ns()
        limit = self.limit()

        def run(txn) -> list[PinInfo]:
            wanted = self._session_keys(txn, session_id, namespace)
            found = [(k, s) for k in wanted if (s := self._current(txn, k)) is not None]
            if not found:
                raise SnapshotNotFound(f"no session {session_id!r} in namespace {namespace!r} to pin in the store "
                                       f"at {self.ctx.root}")
            adding = sum(s.nbytes for _k, s in found)
            mine = {k for k, _s in found}
            held = sum(s.nbytes for k, s, _e in self._live(txn, now) if s is not None and k not in mine)
            if limit is not None and held + adding > limit:
                raise PinLimitExceeded(
                    f"pin of session {session_id!r} (namespace {namespace!r}, {adding} bytes) refused in the store "
                    f"at {self.ctx.root}: pins would hold {held + adding} bytes, over the pin limit of {limit} bytes "
                    f"(--max-pinned-bytes; default half the store's budget). Unpin a session or raise the limit.")
            record = msgspec.msgpack.encode([now, ttl_ns])
            for k, _s in found:
                txn.put(TABLE, k, record)
            return [PinInfo(s.session_id, s.namespace, k, s.nbytes, None if not ttl_ns else (now + ttl_ns) / 1e9)
                    for k, s in found]

        return self.index.write(run)

    def unpin(self, session_id: str, namespace: str = "") -> bool:
        """Drop the session's pin; False when it had none."""

        def run(txn) -> bool:
            return any([txn.delete(TABLE, k) for k in self._session_keys(txn, session_id, namespace)])

        return self.index.write(run)

    def forget(self, txn, summary: Summary) -> None:
        """In the write transaction that removes the session's snapshot (delete, eviction, quarantine)."""
        txn.delete(TABLE, keys.summary_session_key(summary))

    def protects(self, txn, sid: bytes, now_ns: int | None = None) -> bool:
        """True when the snapshot ``sid`` is its session's current one and the session holds an unexpired pin.
        ``txn`` is a write transaction: a pin found expired is dropped there."""
        s = self._summary(txn, sid)
        if s is None:
            return False
        skey = keys.summary_session_key(s)
        raw = txn.get(TABLE, skey)
        if raw is None:
            return False
        pinned_at, ttl = _decode(bytes(raw))
        expires = _expires_ns(pinned_at, ttl, s.last_used_ns)
        if expires is not None and expires <= (self._now_ns() if now_ns is None else now_ns):
            txn.delete(TABLE, skey)
            return False
        return True

    def listing(self) -> list[PinInfo]:
        """Every unexpired pin (all identities), with the bytes of each pinned session's current snapshot."""
        now = self._now_ns()
        with self.index.read() as txn:
            return [PinInfo(s.session_id if s else "?", s.namespace if s else "?", k, s.nbytes if s else 0,
                            None if e is None else e / 1e9) for k, s, e in self._live(txn, now)]

    def pinned_bytes(self) -> int:
        """Bytes of the pinned sessions' current snapshots (unexpired pins only)."""
        return sum(p.nbytes for p in self.listing())


__all__ = ["PinInfo", "PinLimitExceeded", "Pins"]
