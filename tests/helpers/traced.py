"""Running a script under ``strace`` for the syscall tests (syncs, read order, durability order).

One place for finding strace and for running a child process under it, so each test only says what to trace and
how to read it. A test that traces declares ``@pytest.mark.host_feature("strace")``: it skips, with the reason,
where strace is missing or ptrace is refused (``host_features.py``; ``.ci/run`` installs strace)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from host_features import need


def strace_path() -> str:
    need("strace")  # probed once: installed, and ptrace is allowed
    path = shutil.which("strace")
    assert path is not None
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
