"""The inbox watcher: portable snapshot files dropped into a directory flow into the store by themselves.

Rules (each one is what a fleet operator can rely on):

* a candidate is a regular file directly in the inbox whose name ends in ``.safetensors`` and does not start with
  ``.`` (writers that complete by rename write ``.name.tmp`` or ``name.safetensors.part`` first);
* a candidate is touched only once it is *settled*: the same size and mtime at two looks at least ``poll`` apart and
  an mtime at least ``settle`` seconds old — a file written slowly in pieces is never read half-written;
* a settled file is verified completely and ingested (``ingest(path)``), then moved to ``done/``; a file the
  ingest rejects as bad data (``CorruptData``, ``IncompatibleFormat``, ``IdentityMismatch``,
  ``InvalidCacheState``) goes to ``failed/`` with ``<name>.reason.txt`` and nothing of it enters the store;
  other errors (disk full, a busy store) leave it in place to be retried;
* watchdog events only wake the loop early; every pass also rescans the directory, so files that arrived while the
  watcher was down (or whose events were lost) are picked up;
* SIGINT/SIGTERM set a stop flag: the file in hand is finished (ingest commits atomically, then the move), nothing
  new is started. If the process dies between the commit and the move, the next run ingests the file again, which
  the idempotent ingest turns into a no-op.

Test seam (no effect unless set): ``phase(name, detail)`` is called at each step — ``seen`` (a candidate's size was
looked at), ``ingest`` (a file is taken in hand, before its ingest), ``filed``, ``signal`` (with the file in hand) —
so tests wait on what the watcher did instead of sleeping. ``env_phase()`` builds one from two environment
variables for a watcher in another process: ``KVSHELF_TEST_WATCH_TRACE=<file>`` appends one line per phase, and
``KVSHELF_TEST_WATCH_HOLD=<file>`` makes each ``ingest`` wait until that file exists, then consume it (one release
per file; a signal sent meanwhile lands, deterministically, with the file in hand).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from ..codecs.snapshot_file import fsync_dir
from ..errors import CorruptData, IdentityMismatch, IncompatibleFormat, InvalidCacheState, KvShelfError

SUFFIX = ".safetensors"
DONE, FAILED = "done", "failed"
# Errors that mean "this file is bad", as opposed to "the store or disk is unwell right now".
FILE_FAULTS: tuple[type[BaseException], ...] = (CorruptData, IncompatibleFormat, IdentityMismatch, InvalidCacheState)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str, *, allow_zero: bool = False) -> float:
    """``"90"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1d"``, ``"500ms"`` -> seconds. Raises ``ValueError`` otherwise."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (expected e.g. 90s, 15m, 2h, 1d)")
    seconds = float(match.group(1)) * _UNIT[match.group(2)]
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"duration must be positive: {text!r}")
    return seconds


@dataclass
class WatchOutcome:
    """What happened to one inbox file."""

    name: str
    status: str  # "done" | "failed"
    detail: str = ""
    result: Any = None


@dataclass
class _Seen:
    size: int
    mtime_ns: int
    since: float  # monotonic time this (size, mtime) was first observed


@dataclass
class WatchStats:
    outcomes: list[WatchOutcome] = field(default_factory=list)
    compactions: int = 0

    @property
    def done(self) -> int:
        return sum(o.status == DONE for o in self.outcomes)

    @property
    def failed(self) -> int:
        return sum(o.status == FAILED for o in self.outcomes)


class _Wake(FileSystemEventHandler):
    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._event.set()


def _unique_target(directory: Path, name: str) -> Path:
    target = directory / name
    n = 1
    while target.exists() or (directory / f"{target.name}.reason.txt").exists():
        target = directory / f"{Path(name).stem}.{n}{Path(name).suffix}"
        n += 1
    return target


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


Phase = Callable[[str, str], None]
TRACE_ENV, HOLD_ENV = "KVSHELF_TEST_WATCH_TRACE", "KVSHELF_TEST_WATCH_HOLD"


def _no_phase(_name: str, _detail: str) -> None:
    pass


def env_phase(hold_limit: float = 600.0) -> Phase:
    """The phase seam for a watcher in another process (see the module docstring); a no-op when neither is set."""
    trace, hold = os.environ.get(TRACE_ENV), os.environ.get(HOLD_ENV)
    if not trace and not hold:
        return _no_phase

    def phase(name: str, detail: str) -> None:
        if trace:
            with open(trace, "a", encoding="utf-8") as fh:
                fh.write(f"{name} {detail}\n")
        if hold and name == "ingest":
            deadline = time.monotonic() + hold_limit
            while not os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                os.unlink(hold)  # one release per ingest: the next file waits for the next one
            except FileNotFoundError:
                pass

    return phase


class InboxWatcher:
    """Polls (woken early by watchdog) an inbox directory and hands settled snapshot files to ``ingest``."""

    def __init__(
        self,
        inbox: str | os.PathLike[str],
        ingest: Callable[[Path], Any],
        *,
        settle: float = 1.0,
        poll: float = 0.25,
        compact: Callable[[], Any] | None = None,
        compact_every: float | None = None,
        log: Callable[[str], None] = lambda _msg: None,
        phase: Phase = _no_phase,
    ) -> None:
        self.inbox = Path(inbox)
        self.phase = phase
        self._in_hand: str | None = None
        self.ingest, self.compact, self.compact_every = ingest, compact, compact_every
        self.settle, self.poll, self.log = settle, poll, log
        self.stop_event = threading.Event()
        self._wake = threading.Event()
        self._seen: dict[str, _Seen] = {}
        self._retry_after: dict[str, float] = {}
        self.stats = WatchStats()
        for sub in (DONE, FAILED):
            (self.inbox / sub).mkdir(mode=0o700, parents=True, exist_ok=True)

    # --- one pass -------------------------------------------------------------------------------------------------
    def settled(self) -> list[Path]:
        """Candidates whose size and mtime have held still long enough, oldest first."""
        now_mono, now_wall = time.monotonic(), time.time()
        ready: list[tuple[int, Path]] = []
        present: set[str] = set()
        with os.scandir(self.inbox) as entries:
            for entry in entries:
                if entry.name.startswith(".") or not entry.name.endswith(SUFFIX):
                    continue
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                present.add(entry.name)
                self.phase("seen", f"{entry.name} {st.st_size}")
                seen = self._seen.get(entry.name)
                if seen is None or (seen.size, seen.mtime_ns) != (st.st_size, st.st_mtime_ns):
                    self._seen[entry.name] = _Seen(st.st_size, st.st_mtime_ns, now_mono)
                    continue
                if now_mono - seen.since < self.poll or now_wall - st.st_mtime_ns / 1e9 < self.settle:
                    continue
                if self._retry_after.get(entry.name, 0.0) > now_mono:
                    continue
                ready.append((st.st_mtime_ns, Path(entry.path)))
        for gone in set(self._seen) - present:
            del self._seen[gone]
        return [path for _, path in sorted(ready)]

    def handle(self, path: Path) -> WatchOutcome | None:
        """Verify + ingest one settled file, then file it under done/ or failed/."""
        self._in_hand = path.name
        try:
            return self._handle(path)
        finally:
            self._in_hand = None

    def _handle(self, path: Path) -> WatchOutcome | None:
        self.phase("ingest", path.name)
        try:
            result = self.ingest(path)
        except FILE_FAULTS as exc:
            reason = f"{type(exc).__name__}: {exc}\n"
            target = _unique_target(self.inbox / FAILED, path.name)
            _write_private(target.with_name(target.name + ".reason.txt"), reason)
            os.replace(path, target)
            fsync_dir(self.inbox / FAILED)
            self._seen.pop(path.name, None)
            self.log(f"failed {path.name}: {reason.strip()}")
            outcome = WatchOutcome(path.name, FAILED, reason.strip())
        except FileNotFoundError:
            self._seen.pop(path.name, None)  # taken away under us; nothing to file
            return None
        except (OSError, KvShelfError) as exc:  # disk full, store busy: not the file's fault, try again later
            self._retry_after[path.name] = time.monotonic() + max(5.0, self.settle)
            self.log(f"retrying {path.name} later: {type(exc).__name__}: {exc}")
            return None
        else:
            target = _unique_target(self.inbox / DONE, path.name)
            os.replace(path, target)
            fsync_dir(self.inbox / DONE)
            self._seen.pop(path.name, None)
            self.log(f"ingested {path.name}")
            outcome = WatchOutcome(path.name, DONE, "", result)
        self.stats.outcomes.append(outcome)
        self.phase("filed", f"{outcome.status} {path.name}")
        return outcome

    def run_once(self) -> int:
        """One pass over the inbox; returns how many files were filed."""
        filed = 0
        for path in self.settled():
            if self.stop_event.is_set():
                break
            if self.handle(path) is not None:
                filed += 1
        return filed

    # --- the loop -------------------------------------------------------------------------------------------------
    def run(self, *, until_idle: float | None = None) -> WatchStats:
        """Watch until ``stop_event`` is set (or, with ``until_idle``, until nothing arrived for that long)."""
        observer = Observer()
        observer.schedule(_Wake(self._wake), str(self.inbox), recursive=False)
        observer.start()
        last_compact = time.monotonic()
        last_activity = time.monotonic()
        try:
            while not self.stop_event.is_set():
                if self.run_once():
                    last_activity = time.monotonic()
                if (
                    self.compact is not None
                    and self.compact_every is not None
                    and time.monotonic() - last_compact >= self.compact_every
                    and not self.stop_event.is_set()
                ):
                    self.compact()
                    self.stats.compactions += 1
                    last_compact = time.monotonic()
                if until_idle is not None and not self._seen and time.monotonic() - last_activity >= until_idle:
                    break
                self._wake.wait(self.poll)
                self._wake.clear()
        finally:
            observer.stop()
            observer.join(timeout=5)
        return self.stats

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM stop the loop after the file in hand (main thread only)."""

        def _stop(signum: int, _frame: object) -> None:
            self.log(f"received {signal.Signals(signum).name}; finishing the file in hand")
            self.phase("signal", f"{signal.Signals(signum).name} in-hand={self._in_hand or '-'}")
            self.stop_event.set()
            self._wake.set()

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)


__all__ = ["env_phase", "TRACE_ENV", "HOLD_ENV", "InboxWatcher", "WatchOutcome", "WatchStats", "parse_duration", "FILE_FAULTS"]
