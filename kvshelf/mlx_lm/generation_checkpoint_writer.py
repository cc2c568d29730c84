"""Write-behind of *generation* checkpoints (docs/RESUMING.md): decode never waits for the disk, a completed
generation leaves none. (The prompt's prefix checkpoints of ``--checkpoint-every``, docs/CHECKPOINTS.md, are
another feature: ``checkpoints.py``, ``serve/prefix_checkpoints.py``.)

Why a writer of its own: a generation checkpoint is captured in the decode thread (the store's background save
snapshots and evaluates the caches at once, so later in-place cache updates cannot leak into it) and written on the
store's writer thread. Its ``WriteBehindQueue`` (``write_behind.py``) holds at most one write per continuation key
and at most ``max_in_flight`` in all: a checkpoint that finds its key still writing or the queue full is skipped
and counted (the next one will come). ``complete(key)`` deletes the key's checkpoints after any write of it still
in flight, so a late write cannot outlive its generation.

Log lines (operators and tests wait on them), one per event::

    kvshelf generation checkpoint tokens=812 generated=512 key=<sha256 hex>
    kvshelf generation checkpoints dropped count=2 key=<sha256 hex>

``counters`` is a plain dict (shared with whoever made the writer; the server's metrics read it).
"""

from __future__ import annotations

import logging
from typing import Any

from ..store.save import QUEUED, WriteBehindQueue

log = logging.getLogger("kvshelf.generation")

COUNTERS = ("checkpoints_queued", "checkpoints_durable", "checkpoints_failed", "checkpoints_skipped_full",
            "checkpoints_dropped", "drops_failed", "resumes", "resumed_tokens", "requests_not_resumable",
            "requests_short", "requests_batched", "batch_rows_peak")


class GenerationCheckpointWriter:
    """Generation checkpoint writes in flight for any number of stores and keys (see the module docstring)."""

    def __init__(self, *, max_in_flight: int = 4, counters: dict | None = None,
                 logger: logging.Logger | None = None):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.counters = counters if counters is not None else {}
        for name in COUNTERS:
            self.counters.setdefault(name, 0)
        self.log = logger or log
        self.queue = WriteBehindQueue(max_entries=max_in_flight, logger=self.log)

    def submit(self, store: Any, key: str, tokens: list[int], caches: list[Any], *, prompt_length: int,
               pending_token: int, sampler_state: bytes | None, tenant: str = "") -> bool:
        """Capture now, write behind; False when skipped (key still writing, queue full, or the capture failed).
        ``tenant`` files the checkpoint in that tenant's namespace (``forget_tenant`` removes it)."""
        n, generated = len(tokens), len(tokens) - prompt_length

        def start():
            return store.save_generation_checkpoint(key, tokens, caches, prompt_length=prompt_length,
                                                    pending_token=pending_token, sampler_state=sampler_state,
                                                    background=True, tenant=tenant)

        def durable(fut) -> None:
            exc = fut.exception()
            if exc is None:
                self.counters["checkpoints_durable"] += 1
                self.log.info("kvshelf generation checkpoint tokens=%d generated=%d key=%s", n, generated, key)
            else:
                self.counters["checkpoints_failed"] += 1
                self.log.warning("kvshelf generation checkpoint failed (tokens=%d): %s: %s", n,
                                 type(exc).__name__, exc)

        try:
            said = self.queue.submit(key, 0, start, durable)
        except Exception as exc:  # noqa: BLE001 - a checkpoint is an optimisation: never fail the generation
            self.counters["checkpoints_failed"] += 1
            self.log.warning("kvshelf generation checkpoint failed (tokens=%d): %s: %s", n, type(exc).__name__, exc)
            return False
        if said != QUEUED:
            self.counters["checkpoints_skipped_full"] += 1
            self.log.warning("kvshelf generation checkpoint skipped: a write is still in flight (tokens=%d "
                             "key=%s)", n, key)
            return False
        self.counters["checkpoints_queued"] += 1
        return True

    def complete(self, store: Any, key: str, tenant: str = "") -> None:
        """The generation of ``key`` completed: delete its checkpoints now, or after its write in flight."""
        self.queue.after(key, lambda: self._drop(store, key, tenant))

    def _drop(self, store: Any, key: str, tenant: str = "") -> None:
        try:
            count = store.drop_generation_checkpoints(key, tenant=tenant)
        except Exception as exc:  # noqa: BLE001 - left for budget eviction; never fail the answered request
            self.counters["drops_failed"] += 1
            self.log.warning("kvshelf generation checkpoints not dropped (key=%s): %s: %s", key,
                             type(exc).__name__, exc)
            return
        self.counters["checkpoints_dropped"] += count
        self.log.info("kvshelf generation checkpoints dropped count=%d key=%s", count, key)

    @property
    def in_flight(self) -> int:
        return self.queue.pending

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no generation checkpoint write (nor a drop waiting on one) is in flight; True when none is
        left."""
        return self.queue.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Take no more checkpoints and flush within ``timeout``."""
        return self.queue.close(timeout)


__all__ = ["COUNTERS", "GenerationCheckpointWriter"]
