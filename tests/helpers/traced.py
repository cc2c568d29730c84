"""Running a script under ``strace`` for the syscall tests (syncs, read order, durability order).

One place for finding strace (skipping with the reason where it is missing or ptrace is refused; ``.ci/run``
installs it) and for running a child process under it, so each test only says what to trace and how to read it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest


def strace_path() -> str:
    path = shutil.which("strace")
    if path is None:
        pytest.skip("strace is not installed (apt-get install -y strace; .ci/run installs it)")
    probe = subprocess.run([path, "-f", "-o", os.devnull, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here (ptrace refused?): {probe.stderr.strip()[:200]}")
    return path


def run_traced(tmp_path: Path, script: str, calls: Sequence[str], flags: Sequence[str] = ()) -> str:
    """Run ``script`` (Python source) in a child under ``strace -f -qq [flags] -e trace=<calls>``; the trace text."""
    strace = strace_path()
    path, trace = tmp_path / "run.py", tmp_path / "trace.txt"
    path.write_text(script)
    done = subprocess.run([strace, "-f", "-qq", *flags, "-e", f"trace={','.join(calls)}", "-o", str(trace),
                           sys.executable, str(path)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return trace.read_text()


__all__ = ["run_traced", "strace_path"]
