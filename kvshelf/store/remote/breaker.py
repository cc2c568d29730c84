"""A circuit breaker for the shared tier: after a few failures in a row, stop asking for a while, then probe.

Why: a remote that is down or stalled must cost a serving process nothing — not a timeout per lookup, not a publish
thread spinning on errors. Closed: calls go through. ``failures`` consecutive failures open it for ``backoff``
seconds (doubling up to ``max_backoff`` each time a probe fails, with jitter so a fleet does not probe in step).
After the backoff one caller is let through (half-open); its success closes the breaker, its failure re-opens it.
"""

from __future__ import annotations

import random
import threading
import time


class CircuitBreaker:
    def __init__(self, failures: int = 3, backoff: float = 0.5, max_backoff: float = 30.0,
                 clock=time.monotonic):
        self.threshold, self.base, self.max_backoff, self.clock = failures, backoff, max_backoff, clock
        self._lock = threading.Lock()
        self._failures = 0
        self._backoff = backoff
        self._open_until = 0.0
        self._probing = False
        self.opened = 0       # times the breaker opened
        self.short_circuited = 0  # calls refused while open

    @property
    def state(self) -> str:
        with self._lock:
            if self._failures < self.threshold:
                return "closed"
            return "half-open" if self.clock() >= self._open_until else "open"

    def allow(self) -> bool:
        """May a call go to the remote now? (At most one probe at a time once the backoff has passed.)"""
        with self._lock:
            if self._failures < self.threshold:
                return True
            if self.clock() >= self._open_until and not self._probing:
                self._probing = True
                return True
            self.short_circuited += 1
            return False

    def success(self) -> None:
        with self._lock:
            self._failures, self._backoff, self._probing = 0, self.base, False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._failures >= self.threshold:
                if self._probing:  # a failed probe: wait longer next time
                    self._backoff = min(self._backoff * 2, self.max_backoff)
                self._probing = False
                self._open_until = self.clock() + self._backoff * random.uniform(0.8, 1.2)
                self.opened += 1


__all__ = ["CircuitBreaker"]
