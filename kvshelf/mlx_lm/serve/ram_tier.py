"""The RAM tier bounded by bytes: ``--prompt-cache-bytes`` and allocation failures that never kill the server.

Why: mlx-lm 0.32 builds its ``LRUPromptCache`` with a count bound only (``--prompt-cache-size``); its own
``--prompt-cache-bytes`` trims only while a batch runs, so a server fed distinct long prompts grows until the
machine swaps or the process dies. ``BoundedRam`` wraps the ``LRUPromptCache`` (built with ``max_bytes`` too) and
makes room *before* an insert (least recently used first), so the tier's bytes never exceed the bound, not even
for the moment between an insert and mlx-lm's own trim. An entry larger than the whole bound is kept out of RAM
(the store still writes it behind). An allocation failure while inserting (MLX raises ``MemoryError`` or
``RuntimeError`` when Metal or the heap refuses a buffer) empties the tier and serves the request without keeping
its cache: the request was already answered, and the generation thread must not die for a cache.

Every entry dropped is counted by reason (``EVICTION_REASONS``: ``bytes``: made room for the bound; ``trim``:
mlx-lm's batch trim under ``--prompt-cache-bytes``; ``too_large``: an entry over the whole bound;
``allocation_failure``: the tier emptied after a failed insert, the entry itself included), read at scrape time as
``kvshelf_evictions_total{tier="ram",reason}``; ``kvshelf_ram_bytes`` and ``kvshelf_ram_peak_bytes`` (the most
the tier held after any insert) show the bound holds.

Test seam: ``KVSHELF_FAULT_RAM_INSERT=N`` makes the N-th insert (1-based, once) raise ``MemoryError`` as MLX would.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("kvshelf.serve")

EVICTION_REASONS = ("bytes", "trim", "too_large", "allocation_failure")
DEFAULT_FRACTION = 0.25  # of physical memory: the default --prompt-cache-bytes
FAULT_ENV = "KVSHELF_FAULT_RAM_INSERT"


def physical_memory() -> int:
    """Bytes of physical memory (0 when the system cannot say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def default_prompt_cache_bytes() -> int:
    """``DEFAULT_FRACTION`` of physical memory (1 GiB when it cannot be read)."""
    total = physical_memory()
    return int(total * DEFAULT_FRACTION) if total else 1 << 30


def _entry_bytes(prompt_cache: list[Any]) -> int:
    return sum(int(getattr(c, "nbytes", 0) or 0) for c in prompt_cache)


class BoundedRam:
    """mlx-lm's ``LRUPromptCache`` (``lru``) held within ``max_bytes``; the same interface the server calls."""

    def __init__(self, lru, max_bytes: int, *, logger: logging.Logger | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.lru = lru
        self.max_bytes = int(max_bytes)
        self.log = logger or log
        self.evictions = dict.fromkeys(EVICTION_REASONS, 0)
        self.peak_bytes = 0
        self.inserts = 0
        self._lock = threading.Lock()
        fault = os.environ.get(FAULT_ENV, "").strip()
        self._fail_at = int(fault) if fault.isdigit() else None

    # ------------------------------------------------------------------ LRUPromptCache's interface
    def __len__(self) -> int:
        return len(self.lru)

    @property
    def nbytes(self) -> int:
        return self.lru.nbytes

    def stats_by_type(self) -> dict:
        return self.lru.stats_by_type()

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        return self.lru.fetch_nearest_cache(model, tokens)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        with self._lock:
            self._trim("trim", n_sequences=n_sequences, n_bytes=n_bytes)

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        entry = _entry_bytes(prompt_cache)
        with self._lock:
            self.inserts += 1
            if entry > self.max_bytes:  # alone over the bound: RAM never holds it (the store does)
                self.evictions["too_large"] += 1
                self.log.debug("kvshelf RAM tier: an entry of %d bytes is over --prompt-cache-bytes %d, not kept",
                               entry, self.max_bytes)
                return
            self._trim("bytes", n_bytes=self.max_bytes - entry)
            try:
                if self._fail_at is not None and self.inserts == self._fail_at:
                    raise MemoryError(f"injected by {FAULT_ENV}={self._fail_at}")
                self.lru.insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            except (MemoryError, RuntimeError) as exc:  # MLX could not allocate: drop the tier, keep serving
                dropped = len(self.lru)
                self._drop_everything()
                self.evictions["allocation_failure"] += dropped + 1
                self.log.warning("kvshelf RAM tier: allocation failed while inserting %d tokens (%s: %s); the RAM "
                                 "tier was emptied (%d entries), the request is served", len(tokens),
                                 type(exc).__name__, exc, dropped)
                return
            self.peak_bytes = max(self.peak_bytes, self.lru.nbytes)

    # ------------------------------------------------------------------ internals
    def _trim(self, reason: str, **bound) -> None:
        before = len(self.lru)
        self.lru.trim_to(**bound)
        self.evictions[reason] += max(0, before - len(self.lru))

    def _drop_everything(self) -> None:
        try:
            self.lru.trim_to(n_sequences=0)
        except Exception:  # noqa: BLE001 - a half-updated LRU after a failed insert: start a fresh one
            self.lru.__init__(self.lru.max_size, self.lru.max_bytes)

    def figures(self) -> dict[str, Any]:
        """What ``/metrics`` and the status page read: bytes, bound, peak, entries, evictions by reason."""
        with self._lock:
            return {"bytes": self.lru.nbytes, "max_bytes": self.max_bytes, "peak_bytes": self.peak_bytes,
                    "entries": len(self.lru), "evictions": dict(self.evictions)}


__all__ = ["BoundedRam", "DEFAULT_FRACTION", "EVICTION_REASONS", "FAULT_ENV", "default_prompt_cache_bytes",
           "physical_memory"]
