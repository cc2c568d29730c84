"""The one write-behind queue: writes the caller never waits for, bounded, one per key, counted.

Why one class: every writer behind a caller's back — ``kvshelf serve``'s prompt-cache write-behind
(``kvshelf/mlx_lm/serve/prompt_cache.py``, which also carries the prefix checkpoints of ``--checkpoint-every``), its
generation checkpoint writer (``kvshelf/mlx_lm/generation_checkpoint_writer.py``) and the shared tier's publisher
(``store/remote/tier.py``) — needs the same things — a bound on the writes in flight (count and bytes) so that generation never waits for the disk (a write that
finds the queue full is refused and counted), at most one write per key in flight, ``flush(timeout)`` at shutdown,
``close()`` that stops taking writes, and counts for the metrics and the status page. Each writer composes one
``WriteBehindQueue`` and keeps only what is its own (what to write, how to log and count it in its own terms).

The worker thread is a ``BackgroundWriter`` (``background.py``: the store's own behind ``save_async``, or the shared
tier's publisher): ``start`` (given to ``submit``) must capture the write in the calling thread — ``Store.save_async`` and ``save_generation_checkpoint(background=True)`` snapshot and evaluate the
caches at once, so the caller's later in-place updates cannot leak into the write — and returns the store's future;
the queue accounts for it until that future is done. A capture deferred to another thread would write whatever the
caches hold by then.

Counts (``counts()``): ``queued`` (accepted, the write started), ``written`` (its future succeeded), ``failed`` (the
capture raised or the future failed) and ``dropped`` (refused: the queue was full). A write refused because its key
is already in flight is not counted here: the writer says what that means (a duplicate, a skipped generation
checkpoint).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvshelf.write_behind")

QUEUED, FULL, BUSY, CLOSED = "queued", "full", "busy", "closed"  # what ``submit`` says
COUNTS = ("queued", "written", "failed", "dropped")


class WriteBehindQueue:
    """Writes in flight, at most ``max_entries`` and ``max_bytes`` (None: no byte bound) of them, one per key. A
    single write larger than ``max_bytes`` goes through only when nothing else is in flight."""

    def __init__(self, *, max_entries: int, max_bytes: int | None = None, logger: logging.Logger | None = None):
        if max_entries < 1 or (max_bytes is not None and max_bytes < 0):
            raise ValueError(f"max_entries must be >= 1 and max_bytes >= 0, got {max_entries}, {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.log = logger or log
        self._cond = threading.Condition()
        self._writing: dict[str, int] = {}  # key -> bytes in flight
        self._after: dict[str, list[Callable[[], None]]] = {}  # key -> to run once its write ended
        self._bytes = 0
        self._closed = False
        self._counts = dict.fromkeys(COUNTS, 0)

    # ------------------------------------------------------------------ writing
    def busy(self, key: str) -> bool:
        """Whether a write of ``key`` is in flight."""
        with self._cond:
            return key in self._writing

    def submit(self, key: str, nbytes: int, start: Callable[[], Any], done: Callable[[Any], None]) -> str:
        """Start a write of ``key`` (``nbytes``) when the queue takes it: ``start()`` captures it and returns the
        store's future; ``done(future)`` runs when that future is done (before the write leaves the queue).
        Returns ``QUEUED``, or why nothing started: ``CLOSED``, ``BUSY`` (the key is in flight) or ``FULL``. When
        ``start`` raises, the write leaves the queue, counts as failed, and the exception propagates."""
        with self._cond:
            if self._closed:
                return CLOSED
            if key in self._writing:
                return BUSY
            n = len(self._writing)
            if n >= self.max_entries or (n and self.max_bytes is not None and self._bytes + nbytes > self.max_bytes):
                self._counts["dropped"] += 1
                return FULL
            self._writing[key] = nbytes
            self._bytes += nbytes
        try:
            future = start()
        except BaseException:
            with self._cond:
                self._counts["failed"] += 1
            self._release(key)
            raise
        with self._cond:
            self._counts["queued"] += 1
        future.add_done_callback(lambda fut: self._finished(fut, key, done))
        return QUEUED

    def _finished(self, future: Any, key: str, done: Callable[[Any], None]) -> None:
        with self._cond:
            self._counts["failed" if future.exception() is not None else "written"] += 1
        try:
            done(future)
        except Exception as exc:  # noqa: BLE001 - a writer's bookkeeping must not keep the write in flight
            self.log.warning("kvshelf write-behind: bookkeeping of %s failed: %s: %s", key, type(exc).__name__, exc)
        self._release(key)

    def after(self, key: str, action: Callable[[], None]) -> None:
        """Run ``action`` once no write of ``key`` is in flight: now, or when its write ends. A deferred action
        runs while the write still counts as in flight, so ``flush`` waits for it too."""
        with self._cond:
            if key in self._writing:
                self._after.setdefault(key, []).append(action)
                return
        action()

    def _release(self, key: str) -> None:
        """The write of ``key`` ended: run the actions waiting on it (and any added meanwhile), then let it go."""
        while True:
            with self._cond:
                actions = self._after.pop(key, [])
                if not actions:
                    self._bytes -= self._writing.pop(key)
                    self._cond.notify_all()
                    return
            for action in actions:
                try:
                    action()
                except Exception as exc:  # noqa: BLE001 - as in _finished
                    self.log.warning("kvshelf write-behind: action after %s failed: %s: %s", key,
                                     type(exc).__name__, exc)

    # ------------------------------------------------------------------ reading, flushing, closing
    @property
    def pending(self) -> int:
        """Writes in flight."""
        with self._cond:
            return len(self._writing)

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def counts(self) -> dict[str, int]:
        """``queued``, ``written``, ``failed``, ``dropped`` since the queue was made (see the module docstring)."""
        with self._cond:
            return dict(self._counts)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no write (nor an action waiting on one) is in flight, at most ``timeout`` seconds; True when
        none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Take no more writes (``submit`` says ``CLOSED``) and flush within ``timeout``; True when none is left.
        Writes still running at the deadline are abandoned to the store's own writer."""
        with self._cond:
            self._closed = True
        return self.flush(timeout)


__all__ = ["BUSY", "CLOSED", "COUNTS", "FULL", "QUEUED", "WriteBehindQueue"]
