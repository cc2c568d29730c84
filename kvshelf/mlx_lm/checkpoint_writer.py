"""Write-behind of generation checkpoints: decode never waits for the disk, a completed generation leaves none.

Why a writer of its own: a checkpoint is captured in the decode thread (the store's background save snapshots and
evaluates the caches at once, so later in-place cache updates cannot leak into it) and written on the store's writer
thread. At most one write per continuation key is in flight and at most ``max_in_flight`` in all: a checkpoint that
finds its key still writing or the queue full is skipped and counted (the next one will come). ``complete(key)``
deletes the key's checkpoints after any write of it still in flight, so a late write cannot outlive its generation.

Log lines (operators and tests wait on them), one per event::

    kvshelf generation checkpoint tokens=812 generated=512 key=<sha256 hex>
    kvshelf generation checkpoints dropped count=2 key=<sha256 hex>

``counters`` is a plain dict (shared with whoever made the writer; the server's metrics read it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("kvshelf.generation")

COUNTERS = ("checkpoints_queued", "checkpoints_durable", "checkpoints_failed", "checkpoints_skipped_full",
            "checkpoints_dropped", "drops_failed", "resumes", "resumed_tokens", "requests_not_resumable",
            "requests_short")


class CheckpointWriter:
    """Checkpoint writes in flight for any number of stores and keys (see the module docstring)."""

    def __init__(self, *, max_in_flight: int = 4, counters: dict | None = None,
                 logger: logging.Logger | None = None):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.counters = counters if counters is not None else {}
        for name in COUNTERS:
            self.counters.setdefault(name, 0)
        self.log = logger or log
        self._cond = threading.Condition()
        self._writing: dict[str, int] = {}  # key -> writes in flight
        self._drop_after: dict[str, Any] = {}  # key -> store: drop once its writes are done

    def submit(self, store: Any, key: str, tokens: list[int], caches: list[Any], *, prompt_length: int,
               pending_token: int, sampler_state: bytes | None) -> bool:
        """Capture now, write behind; False when skipped (key still writing, queue full, or the capture failed)."""
        with self._cond:
            if self._writing.get(key) or sum(self._writing.values()) >= self.max_in_flight:
                self.counters["checkpoints_skipped_full"] += 1
                self.log.warning("kvshelf generation checkpoint skipped: a write is still in flight (tokens=%d "
                                 "key=%s)", len(tokens), key)
                return False
            self._writing[key] = self._writing.get(key, 0) + 1
        n, generated = len(tokens), len(tokens) - prompt_length
        try:
            future = store.save_generation_checkpoint(key, tokens, caches, prompt_length=prompt_length,
                                                      pending_token=pending_token, sampler_state=sampler_state,
                                                      background=True)
        except Exception as exc:  # noqa: BLE001 - a checkpoint is an optimisation: never fail the generation
            self.counters["checkpoints_failed"] += 1
            self.log.warning("kvshelf generation checkpoint failed (tokens=%d): %s: %s", n, type(exc).__name__, exc)
            self._finished(key)
            return False
        self.counters["checkpoints_queued"] += 1

        def durable(fut) -> None:
            exc = fut.exception()
            if exc is None:
                self.counters["checkpoints_durable"] += 1
                self.log.info("kvshelf generation checkpoint tokens=%d generated=%d key=%s", n, generated, key)
            else:
                self.counters["checkpoints_failed"] += 1
                self.log.warning("kvshelf generation checkpoint failed (tokens=%d): %s: %s", n,
                                 type(exc).__name__, exc)
            self._finished(key)

        future.add_done_callback(durable)
        return True

    def _finished(self, key: str) -> None:
        """A write of ``key`` ended. A drop waiting on it runs while the write still counts as in flight (so
        ``flush`` also waits for the drop)."""
        while True:
            with self._cond:
                store = self._drop_after.pop(key, None) if self._writing[key] == 1 else None
                if store is None:
                    self._writing[key] -= 1
                    if not self._writing[key]:
                        del self._writing[key]
                    self._cond.notify_all()
                    return
            self._drop(store, key)

    def complete(self, store: Any, key: str) -> None:
        """The generation of ``key`` completed: delete its checkpoints now, or after its write in flight."""
        with self._cond:
            if self._writing.get(key):
                self._drop_after[key] = store
                return
        self._drop(store, key)

    def _drop(self, store: Any, key: str) -> None:
        try:
            count = store.drop_generation_checkpoints(key)
        except Exception as exc:  # noqa: BLE001 - left for budget eviction; never fail the answered request
            self.counters["drops_failed"] += 1
            self.log.warning("kvshelf generation checkpoints not dropped (key=%s): %s: %s", key,
                             type(exc).__name__, exc)
            return
        self.counters["checkpoints_dropped"] += count
        self.log.info("kvshelf generation checkpoints dropped count=%d key=%s", count, key)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(self._writing.values())

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no checkpoint write (nor a drop waiting on one) is in flight; True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True


__all__ = ["COUNTERS", "CheckpointWriter"]
