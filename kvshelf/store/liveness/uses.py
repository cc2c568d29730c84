"""Remembered uses of snapshots: a restore's LRU touch is kept in memory, never committed on the read path.

A use (the snapshot's last-used time and its chunks') is written by the handle's next write transaction — a save,
a delete, close, or a timer ``TOUCH_FLUSH_SECONDS`` later (a background commit, never inside a restore). Lookups and
eviction of this handle see the remembered uses at once (``touched``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec

from ..context import StoreContext
from ..index import keys, tables
from ..index import schema

TOUCH_FLUSH_SECONDS = 2.0

Touches = dict[bytes, tuple[int, list[str]]]  # sid -> (when, hashes) not yet written


class UseBook:
    """The uses one handle has not written yet, and the timer that writes them (``flush``: a write transaction of
    the handle, given by ``Transactions``, which owns this book)."""

    def __init__(self, ctx: StoreContext, flush: Callable[[], None]):
        self.ctx, self._flush = ctx, flush
        self._touches: Touches = {}
        self._timer: threading.Timer | None = None
        self._closing = False

    def remember(self, sid: bytes, hashes: list[str]) -> None:
        if self.ctx.read_only:
            return  # uses are LRU order only: a handle that may not write leaves the order to the owner
        with self.ctx.lock:
            self._touches[sid] = (time.time_ns(), hashes)
            if self._timer is None and not self._closing:
                self._timer = threading.Timer(TOUCH_FLUSH_SECONDS, self._due)
                self._timer.daemon = True
                self._timer.start()

    def touched(self) -> dict[bytes, int]:
        """Uses not yet written, seen by this handle's lookups and eviction."""
        with self.ctx.lock:
            return {sid: when for sid, (when, _h) in self._touches.items()}

    @property
    def pending(self) -> bool:
        return bool(self._touches)

    def take(self) -> Touches:
        with self.ctx.lock:
            touches, self._touches = self._touches, {}
        return touches

    def keep(self, touches: Touches) -> None:
        """Uses a failed transaction did not write: kept for the next one (newer ones win)."""
        with self.ctx.lock:
            for sid, item in touches.items():
                self._touches.setdefault(sid, item)

    def stop(self) -> None:
        """Closing: no new timer; a running one is cancelled (the caller writes what is left)."""
        with self.ctx.lock:
            self._closing = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            timer.join()

    def _due(self) -> None:
        # Never hold the handle's lock across a transaction: transaction bodies take it (liveness/__init__.py).
        with self.ctx.lock:
            self._timer = None
            go = bool(self._touches) and not self._closing
        if go:
            try:
                self._flush()
            except Exception:  # pragma: no cover - retried by the next write of this handle
                pass

    @staticmethod
    def apply(txn, sid: bytes, now: int, hashes: list[str]) -> None:
        """Write one use: the summary's last-used time and LRU key, and each chunk's last use."""
        s = tables.summary(txn, sid)
        if s is None:
            return
        txn.delete("lru", keys.lru_key(s.id_key, s.last_used_ns, sid))
        txn.put("lru", keys.lru_key(s.id_key, now, sid), b"")
        txn.put("summaries", sid, schema.encode(msgspec.structs.replace(s, last_used_ns=now)))
        for h in hashes:
            m = tables.chunk_meta(txn, h)
            if m is not None:
                txn.put("chunks", bytes.fromhex(h), schema.encode(msgspec.structs.replace(m, last_used_ns=now)))


__all__ = ["TOUCH_FLUSH_SECONDS", "UseBook"]
