"""A circuit breaker for the shared tier: after a few failures in a row, stop asking for a while, then probe.

Why: a remote that is down or stalled must cost a serving process nothing — not a timeout per lookup, not a publish
thread spinning on errors. Closed: calls go through. ``failures`` consecutive failures open it for ``backoff``
seconds (doubling up to ``max_backoff`` each time a probe fails, with jitter so a fleet does not probe in step).
After the backoff one caller is let through (half-open); its success closes the breaker, its failure re-opens it.

``on_change(state)``, when set, is called (outside the lock) with ``"open"`` when the breaker first opens after
being closed and with ``"closed"`` when a success closes it again: once per outage each way, never for the probes
that fail in between, so an operator's log says when the remote went away and when it came back, once.
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
        self.on_change = None  # callable(state): "open" when an outage starts, "closed" when it ends

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
            was_open = self._failures >= self.threshold
            self._failures, self._backoff, self._probing = 0, self.base, False
        if was_open:
            self._changed("closed")

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            opening = self._failures == self.threshold  # from closed: the outage starts (later ones are probes)
            if self._failures >= self.threshold:
                if self._probing:  # a failed probe: wait longer next time
                    self._backoff = min(self._backoff * 2, self.max_backoff)
                self._probing = False
                self._open_until = self.clock() + self._backoff * random.uniform(0.8, 1.2)
                self.opened += 1
        if opening:
            self._changed("open")

    def _changed(self, state: str) -> None:
        listener = self.on_change
        if listener is not None:
            listener(state)


__all__ = ["CircuitBreaker"]
