"""Ineffective hits: a request whose prefix was found but that still prefilled more than ``prompt − cached + 1``
tokens. Counted (``kvshelf_ineffective_hits_total``), logged with why, and served correctly.

Why: the failure agents report most on MLX servers is not a miss but a hit that does not pay — a lookup matched
N tokens and the restore silently came back thousands of tokens short (one tracker's thread: 8,191 tokens, 17–27 s
of re-prefill per session). The server then reports a hit while the time to first token says otherwise. Here the
caches a fetch hands to mlx-lm are measured (the attention layers' ``offset``: the tokens they really hold); when
they hold fewer than the fetch reported, the request is served from what they do hold (the rest is prefilled, so
the reply is right), the shortfall is logged (``kvshelf ineffective hit ...``) and, when it exceeds the one token
mlx-lm always recomputes, counted. Caches without an offset (recurrent state) cannot be measured: not checked.

``KVSHELF_TEST_SHORT_RESTORE=N`` (a test seam) cuts the first disk restore of the process N tokens short, so a
test sees the counter move without damaging a store.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

SHORT_RESTORE_ENV = "KVSHELF_TEST_SHORT_RESTORE"


def held_tokens(cache: Sequence[Any] | None) -> int | None:
    """The tokens every measurable layer of ``cache`` holds (the smallest offset), None when none can tell."""
    if not cache:
        return None
    offsets = [int(c.offset) for c in cache if isinstance(getattr(c, "offset", None), int)]
    return min(offsets) if offsets else None


class IneffectiveHits:
    """Checks each fetch (``TieredPromptCache.fetch_nearest_cache``) and tells its observer of ineffective ones."""

    def __init__(self, observer: Any, logger: logging.Logger, short_restore: int | None = None):
        self.observer, self.log = observer, logger
        if short_restore is None:
            raw = os.environ.get(SHORT_RESTORE_ENV)
            short_restore = int(raw) if raw else 0
        self._short = max(0, short_restore)
        self._lock = threading.Lock()
        self.count = 0

    def cut_short(self, cache: list[Any]) -> list[Any]:
        """The test seam: the first disk restore loses its last N tokens (every layer trimmed alike)."""
        with self._lock:
            n, self._short = self._short, 0
        if n:
            for c in cache:
                if hasattr(c, "trim") and getattr(c, "is_trimmable", lambda: False)():
                    c.trim(n)
        return cache

    def check(self, tokens: Sequence[int], cache: Sequence[Any] | None, cached: int, source: str) -> int:
        """The tokens of ``tokens`` the caches truly hold (``cached`` when they cannot be measured); an ineffective
        hit is logged and counted."""
        held = held_tokens(cache) if source != "none" else None
        if held is None or held >= cached:
            return cached
        prefilled = len(tokens) - held
        self.log.warning("kvshelf ineffective hit source=%s matched=%d held=%d prompt=%d prefill=%d: the %s caches "
                         "hold %d tokens fewer than the lookup matched; serving from what they hold", source, cached,
                         held, len(tokens), prefilled, source, cached - held)
        if prefilled > len(tokens) - cached + 1:
            with self._lock:
                self.count += 1
            observe = getattr(self.observer, "observe_ineffective_hit", None)
            if observe is not None:
                observe(source)
        return held


__all__ = ["IneffectiveHits", "SHORT_RESTORE_ENV", "held_tokens"]
