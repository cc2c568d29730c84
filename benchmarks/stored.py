"""Where a stored run goes: ``benchmarks/results/<date>-<commit>[-<label>].md`` and its JSON beside it.

A figure quoted in the README or the docs must be traceable to the file of the run that produced it, and that file
must name the code it measured. So a stored run takes its name from the commit checked out, and is refused while
the measured code (``kvshelf/``, ``benchmarks/``, ``pyproject.toml``) differs from that commit: the results are
committed on top of it afterwards, changing no code.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MEASURED = ("kvshelf", "benchmarks/*.py", "pyproject.toml")


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {REPO}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def measured_commit() -> tuple[str, list[str]]:
    """(short hash of HEAD, the measured files that differ from it): a stored run needs the list empty."""
    return _git("rev-parse", "--short=7", "HEAD"), _git("status", "--porcelain", "--", *MEASURED).splitlines()


def stored_paths(commit: str, label: str | None) -> tuple[Path, Path]:
    """(markdown, JSON) paths of a run of ``commit`` today (UTC), with an optional label for a partial run."""
    if label is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", label):
        raise ValueError(f"--label {label!r}: use lower-case letters, digits and dashes")
    stem = f"{time.strftime('%Y-%m-%d', time.gmtime())}-{commit}" + (f"-{label}" if label else "")
    return RESULTS / f"{stem}.md", RESULTS / f"{stem}.json"
