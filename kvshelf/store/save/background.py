"""The background writer behind ``save_async``: one thread, bounded queued bytes, failures kept for ``flush``."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ...errors import KvShelfError


class BackgroundWriter:
    """Runs submitted jobs in order on one daemon thread; ``submit`` blocks while queued bytes exceed the bound."""

    def __init__(self, max_pending_bytes: int):
        self.max_pending_bytes = max_pending_bytes
        self._jobs: deque[tuple[Callable[[], Any], int, Future]] = deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0
        self._in_flight = 0
        self._errors: list[BaseException] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def submit(self, job: Callable[[], Any], nbytes: int) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise KvShelfError("the store is closed: save_async after close()")
            # A job larger than the whole bound still goes through once the queue is empty.
            while self._pending_bytes and self._pending_bytes + nbytes > self.max_pending_bytes:
                self._cond.wait()
            self._jobs.append((job, nbytes, future))
            self._pending_bytes += nbytes
            self._in_flight += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvshelf-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, nbytes, future = self._jobs.popleft()
            try:
                future.set_result(job())
            except BaseException as exc:  # kept for flush(); the thread keeps serving later jobs
                with self._cond:
                    self._errors.append(exc)
                future.set_exception(exc)
            finally:
                with self._cond:
                    self._pending_bytes -= nbytes
                    self._in_flight -= 1
                    self._cond.notify_all()

    def flush(self) -> None:
        """Wait for every submitted job; re-raise the first failure since the last flush (others are chained)."""
        with self._cond:
            while self._in_flight:
                self._cond.wait()
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop the thread (waiting at most ``timeout`` seconds for it; None: until done)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)


__all__ = ["BackgroundWriter"]
