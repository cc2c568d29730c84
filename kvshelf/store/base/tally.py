"""Per-thread work counters: the recording seams tests and benchmarks count work through (no timing).

Why one class: the sync seam (``syncs.py``: fsyncs and index commits) and the prefix-record seam (``records.py``:
record writes and deletes) both need "count what THIS thread does while a block runs", nested blocks included.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ThreadTally:
    """``counting()`` yields a dict collecting this thread's ``count(kind, n)`` calls while the block runs (every
    open block of the thread counts them); kinds in ``start`` are present from the beginning."""

    def __init__(self, *start: str) -> None:
        self._local = threading.local()
        self._start = start

    @contextmanager
    def counting(self) -> Iterator[dict[str, int]]:
        sink = dict.fromkeys(self._start, 0)
        sinks = getattr(self._local, "sinks", None)
        if sinks is None:
            sinks = self._local.sinks = []
        sinks.append(sink)
        try:
            yield sink
        finally:
            sinks.remove(sink)

    def count(self, kind: str, n: int = 1) -> None:
        for sink in getattr(self._local, "sinks", ()):
            sink[kind] = sink.get(kind, 0) + n


__all__ = ["ThreadTally"]
